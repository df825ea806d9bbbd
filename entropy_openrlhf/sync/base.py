"""What the trainer asks of a weight sync, whatever moves the weights.

A run has one `WeightSync` (factory.py builds it from `--sync.*`). The trainer calls four things:

- `setup()` once, when the policy and the engines are up;
- `publish(version)` on the trainer thread right after optimizer round `version`;
- `make_current()` on the producer thread before each generation (it returns the seconds it spent);
- `engine_lock`, held around every generation and evaluation: a sync that writes into the engines takes it too, so
  weights never change under a generation.

The rollout group calls one more, `engine_back`, when Ray has restarted an engine: the restarted process holds the
initial model, and only the sync knows where the current weights are (a kept copy, or a fresh export).

Each method lives in its own file with both of its ends: object_store.py (chunks through Ray's object store) and
collective.py (a broadcast group, group.py holding the ranks' side). receiver.py is the engines' side of both.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import ray

from entropy_openrlhf.sync.chunks import DEFAULT_MAX_CHUNK_MB


# What the sync uses of the actor groups it drives, so that it sits below them (actors/rollout.py, actors/policy.py
# are what a run passes in; tests pass stand-ins).
class Engines(Protocol):
    actors: list  # the engines' Ray handles (RolloutEngine: update_weights, init_weight_sync, receive_weights, ...)
    version: int  # the policy version every engine holds; the sync sets it
    tensor_parallel_size: int
    num_gpus_per_engine: float

    def recover(self, i: int, why: str, died: bool, reload: bool = True) -> None: ...


class Policy(Protocol):
    actors: list  # the policy ranks' Ray handles
    cfg: Any

    def export_weights(self, timeout_s: float | None = None) -> dict: ...
    def open_weight_sync(self, world_size: int, backend: str, timeout_s: float) -> Any: ...
    def join_weight_sync_async(self) -> ray.ObjectRef: ...
    def broadcast_weights_async(self) -> list[ray.ObjectRef]: ...


class WeightSyncTimeoutError(TimeoutError):
    """An engine did not finish loading new weights in time (hung, busy on a long call, or starved of CPU)."""


SYNC_METHODS: dict[str, type[WeightSync]] = {}


def register_sync_method(cls: type[WeightSync]) -> type[WeightSync]:
    """Class decorator: `--sync.method <cls.method>` builds `cls` (factory.py finds every module of this package)."""
    if cls.method in SYNC_METHODS or cls.method == "auto":
        raise ValueError(f"weight sync method {cls.method!r} is registered twice (or is 'auto', which is reserved)")
    SYNC_METHODS[cls.method] = cls
    return cls


def wait_for_sync(engine_refs: list, policy_refs: list, what: str, timeout_s: float) -> None:
    """Wait for both sides of a sync. An error on either side is raised at once (its peer would only wait for it
    until the timeout); a side still running after `timeout_s` raises WeightSyncTimeoutError naming it."""
    deadline = time.time() + timeout_s
    pending = list(engine_refs) + list(policy_refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
        if not done:
            stalled = [i for i, r in enumerate(engine_refs) if r in pending]
            finished = len(engine_refs) - len(stalled)
            policy = [i for i, r in enumerate(policy_refs) if r in pending]
            raise WeightSyncTimeoutError(
                f"{what} timed out after {timeout_s:.1f} s: "
                + (
                    f"rollout engine(s) {stalled} of {len(engine_refs)} did not finish loading (hung, busy on a long "
                    f"call, or starved of CPU); {finished} engine(s) did"
                    if stalled
                    else f"all {len(engine_refs)} engine(s) finished"
                )
                + (f"; policy rank(s) {policy} did not finish sending" if policy else "")
            )
        ray.get(done)  # re-raises the side's own error


class WeightSync(ABC):
    """One run's weight sync between `policy` and the engines of `rollout`. Building it attaches it to the rollout
    group as the group's way back for restarted engines (`engine_back`): the newest sync built for a group is its
    sync. `max_chunk_mb`: the chunks a restarted engine is reloaded through, whatever the method (object_store.py)."""

    method: ClassVar[str]  # its --sync.method name

    def __init__(
        self,
        rollout: Engines,
        policy: Policy | None,
        *,
        timeout_s: float = 120.0,
        max_chunk_mb: float = DEFAULT_MAX_CHUNK_MB,
    ):
        self.rollout, self.policy, self.timeout_s, self.max_chunk_mb = rollout, policy, timeout_s, max_chunk_mb
        self.engine_lock = threading.Lock()
        self.metrics: dict[str, float] = {}  # timings a sync on the trainer thread measured, logged with its step
        rollout.weight_sync = self

    @property
    def engine_version(self) -> int:
        """The policy version every engine holds (what the samples generated next are labelled with)."""
        return self.rollout.version

    def setup(self) -> float:
        """Build what the method needs between the policy and the engines; return the seconds it took (nothing to
        build unless a method says so)."""
        return 0.0

    @abstractmethod
    def describe(self) -> str:
        """One line for the run's start: the method and what it runs over."""

    @abstractmethod
    def publish(self, version: int) -> None:
        """Trainer thread, right after optimizer round `version`: hand the policy's weights on."""

    def make_current(self) -> float:
        """Producer thread, before a generation: bring the engines up to the newest published weights; return the
        seconds spent (0 when the method has nothing to do here)."""
        return 0.0

    @abstractmethod
    def engine_back(self, i: int, why: str, engine_version: int, restarted: bool, reload: bool) -> None:
        """Engine `i` answers again at `engine_version` (`restarted`: a new process). Give it the current weights
        unless `reload` is False (the caller is about to send every engine new ones), and whatever else the
        method needs of a new process."""
