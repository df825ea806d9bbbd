"""The one place that reads `--sync.*`: its settings (config.py's `SyncConfig` adds the checks) and the weight sync a
run gets from them.

`SYNC_METHODS` names each method with the class that implements it, as a string: a method's module is imported
only where a run builds it (`make_weight_sync` on the driver, `make_sender` on a policy rank). The config reads the
names alone, so it loads neither Ray nor the methods' code, and scripts/gpu_check.py loads it on GPU machines
without Ray. A method is one file, `sync/<name>.py`, holding a `WeightSync` subclass with `method = "<name>"` (and
its side on the policy ranks, if it has one), plus its line in `SYNC_METHODS` (docs/guides/extending.md, 'Add a
weight sync method').
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from entropy_openrlhf.options import option
from entropy_openrlhf.sync.chunks import DEFAULT_MAX_CHUNK_MB

if TYPE_CHECKING:  # annotations only: base.py imports Ray, which the config (it imports this module) must not load
    from entropy_openrlhf.sync.base import Engines, Policy, PolicyRank, RankSender, WeightSync

# --sync.method -> "module:class" of its WeightSync subclass; in this order in --help and in the error messages
SYNC_METHODS: dict[str, str] = {
    "object_store": "entropy_openrlhf.sync.object_store:ObjectStoreSync",
    "collective": "entropy_openrlhf.sync.collective:CollectiveSync",
    "adapter": "entropy_openrlhf.sync.adapter:AdapterSync",
}

AUTO_METHOD = "collective"  # what --sync.method auto picks (resolve_method gives the measurement)
AUTO_LORA_METHOD = "adapter"  # what it picks for a LoRA run (--actor.lora_rank > 0)


@dataclass
class WeightSyncSettings:
    timeout_s: float = option(300.0, "a weight sync that takes longer fails with a clear error instead of hanging")
    method: str = option(
        "auto",
        "{choices}. auto = collective: a broadcast over NCCL when the policy and the engines have GPUs, gloo "
        "otherwise (4.6x faster than the object store for SmolLM2 on CPU, docs/guides/benchmarks.md); for a LoRA run "
        "auto = adapter: only the adapter, served by vLLM's LoRA (collective and object_store send the merged model)",
        choices=("auto", *SYNC_METHODS),
    )
    max_chunk_mb: float = option(
        DEFAULT_MAX_CHUNK_MB,
        "object-store sync, and the reload of a restarted engine under any method: the weights travel in chunks of "
        "at most this many MiB (a larger tensor is split and put back together on the engine). vLLM's RPC refuses "
        "messages over 4 GiB, and each chunk is copied a few times on its way (object store, serialisation, RPC), "
        "so 256 keeps those copies near 1 GB; a 15 GB 7B model is ~60 chunks, whose per-chunk round trip "
        "(milliseconds) is lost in the copy time. Fractions are allowed (tests cut a tiny model into many chunks)",
    )


def resolve_method(method: str, lora: bool = False) -> str:
    """`--sync.method`: auto = collective, over NCCL when the policy and the engines run on CUDA, over gloo
    otherwise (the backend is chosen from what each member sees, group.choose_backend).

    CPU too, by measurement (benchmarks/weight_sync.py, docs/guides/benchmarks.md): on the 2-core CI machine a
    SmolLM2-135M
    sync took 1.04 s by gloo broadcast against 4.78 s by the object store (4.6x, side by side in one run), and the
    broadcast keeps no model-sized copy in Ray's object store (1 GB on CPU). The object store used to be the CPU
    default only because a restarted engine could not rejoin the broadcast group; it now can (the group re-exports
    for it and rebuilds the group)."""
    if method == "auto":
        return AUTO_LORA_METHOD if lora else AUTO_METHOD
    if method not in SYNC_METHODS:
        raise ValueError(f"--sync.method: {method!r} is not one of auto, {', '.join(SYNC_METHODS)}")
    if method == "adapter" and not lora:
        raise ValueError("--sync.method adapter sends a LoRA adapter: it needs --actor.lora_rank > 0")
    return method


def method_class(method: str) -> type[WeightSync]:
    """The `WeightSync` subclass that `SYNC_METHODS` names for `method`, its module imported now."""
    module, _, name = SYNC_METHODS[method].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if cls.method != method:
        raise ValueError(
            f"SYNC_METHODS gives --sync.method {method!r} to {SYNC_METHODS[method]}, whose `method` is {cls.method!r}"
        )
    return cls


def make_weight_sync(
    settings: WeightSyncSettings, rollout: Engines, policy: Policy, lora: bool = False, policy_busy_s: float = 0.0
) -> WeightSync:
    """The run's weight sync between `policy` and `rollout` (`lora`: the policy trains a LoRA adapter), attached to
    the rollout group (not yet set up). `policy_busy_s`: the longest a training step may run (--train.step_timeout_s),
    which a call on the policy ranks may have to wait for; 0: the sync's default."""
    cls = method_class(resolve_method(settings.method, lora))
    # the default lives in base.py, which imports Ray: this module must not (the config imports it)
    busy = {"policy_busy_s": policy_busy_s} if policy_busy_s > 0 else {}
    return cls(rollout, policy, timeout_s=settings.timeout_s, max_chunk_mb=settings.max_chunk_mb, **busy)


def make_sender(method: str, host: PolicyRank) -> RankSender:
    """Sync `method`'s side on the policy rank `host` (the rank asks for it by the name the driver's sync has)."""
    if method not in SYNC_METHODS:
        raise ValueError(f"weight sync method {method!r} is not one of {', '.join(SYNC_METHODS)}")
    sender = method_class(method).sender
    if sender is None:
        raise ValueError(f"weight sync method {method!r} runs nothing on the policy ranks")
    return sender(host)
