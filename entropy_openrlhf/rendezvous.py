"""A torch `TCPStore` server that listens on one address only.

torch's TCPStore server binds every interface whatever host name it is given (the host is where clients connect,
not where the server listens), and `init_process_group("env://")` starts one on MASTER_PORT the same way. On a
machine with a public address that is an open port into the rendezvous of a training job. Binding the socket
ourselves and handing its descriptor to the store (`master_listen_fd`) keeps it on the address the clients are told:
127.0.0.1 for a local run, the node's own address on a cluster.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket

import torch.distributed as dist


def serve_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Host a store on host:port (port 0: one the OS picks, read back from `.port`) listening on `host` alone.
    A taken port raises OSError whose message contains EADDRINUSE (PolicyGroup retries on another)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen()
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(e.errno, f"rendezvous port {host}:{port} is taken (EADDRINUSE)") from e
        raise
    bound_port = sock.getsockname()[1]
    # detach: the store owns the descriptor from here (closing our socket object would close its listener)
    return dist.TCPStore(
        host, bound_port, world_size, True, datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True,
    )  # fmt: skip


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store that `serve_store` hosts at host:port (waits up to `timeout_s` for it)."""
    return dist.TCPStore(host, port, world_size, False, datetime.timedelta(seconds=timeout_s))


def deepspeed_pg_timeout() -> datetime.timedelta:
    """DeepSpeed's default timeout for collectives (`deepspeed.constants.default_pg_timeout`: $DEEPSPEED_TIMEOUT
    minutes, 10 unset), computed as DeepSpeed computes it rather than imported: the driver and vLLM's engines import
    this module (through sync/group.py) and must not load DeepSpeed. tests/unit/test_loopback.py checks that the two
    agree."""
    return datetime.timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", default=10)))


def init_default_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    """torch.distributed's default group for ranks that meet at host:port, rank 0 hosting the store there. The
    same as `init_process_group("env://")` (what DeepSpeed's `init_distributed` would run) except for where the
    store listens. `timeout_s` bounds the wait for the store; collectives keep DeepSpeed's default timeout."""
    store = (serve_store if rank == 0 else connect_store)(host, port, world_size, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=deepspeed_pg_timeout())
