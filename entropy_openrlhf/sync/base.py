"""What the trainer asks of a weight sync, whatever moves the weights, and what a sync may ask of the policy's ranks.

A run has one `WeightSync` (factory.py builds it from `--sync.*`). The trainer calls four things:

- `setup()` once, when the policy and the engines are up;
- `publish(version)` on the trainer thread right after optimizer round `version`;
- `make_current()` on the producer thread before each generation (it returns the seconds it spent);
- `engine_lock`, held around every generation and evaluation: a sync that writes into the engines takes it too, so
  weights never change under a generation.

The rollout group calls one more, `engine_back`, when Ray has restarted an engine: the restarted process holds the
initial model, and only the sync knows where the current weights are (a kept copy, or a fresh export).

Each method lives in its own file with both of its ends: object_store.py (chunks through Ray's object store) and
collective.py (a broadcast group). A method that runs code of its own on the policy's ranks says so with a
`RankSender` subclass (its `sender`): every policy rank hosts one per method and runs its operations when the driver
asks (`WeightSync.on_policy`, through `PolicyActor.sync`), as receiver.py is the engines' side of both methods.
group.py is the broadcast group's transport, chunks.py the object store's wire format. factory.py names the methods
(`SYNC_METHODS`) and imports a method's module only where a run builds it: the config, which reads the names, loads
no Ray (scripts/gpu_check.py loads it on GPU machines without Ray).
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import ray
import torch

from entropy_openrlhf.sync.chunks import DEFAULT_MAX_CHUNK_MB

# What the sync uses of the actor groups it drives, so that it sits below them (actors/rollout.py, actors/policy.py
# are what a run passes in; tests pass stand-ins).


class RemoteMethod(Protocol):
    """A method of a Ray actor handle: `.remote(*args)` submits the call and returns its ref."""

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef: ...


class EngineHandle(Protocol):
    """One rollout engine's Ray handle (actors/engine.py's RolloutEngine): the calls a sync makes on it."""

    update_weights: RemoteMethod  # (chunk refs, version): load the object store's chunks
    init_weight_sync: RemoteMethod  # (host, port, rank offset, world size, backend, timeout): join the broadcast
    receive_weights: RemoteMethod  # (weight list, version): take one broadcast and load it
    identity: RemoteMethod  # () -> (policy version held, process incarnation)
    device_report: RemoteMethod  # () -> (where it runs, whether it sees CUDA)


class Engines(Protocol):
    """The rollout group (actors/rollout.py's RolloutGroup)."""

    actors: Sequence[EngineHandle]
    version: int  # the policy version every engine holds; the sync sets it
    tensor_parallel_size: int
    num_gpus_per_engine: float
    weight_sync: WeightSync | None  # the sync attaches itself here (WeightSync.__init__)

    def recover(self, i: int, why: str, died: bool, reload: bool = True) -> None: ...


class Policy(Protocol):
    """The policy group (actors/policy.py's PolicyGroup): its calls on every rank are actors/group.py's
    `ActorGroup.call_all` and company, which submit in one order on all ranks."""

    cfg: Any  # the run's Config (its --actor.* settings); config.py imports this package, so it is not named here

    def call_all(self, method: str, *args: Any, timeout_s: float | None = None, what: str = "") -> list: ...
    def call_all_async(self, method: str, *args: Any) -> list[ray.ObjectRef]: ...
    def wait(
        self, refs: list[ray.ObjectRef], method: str, *, timeout_s: float | None = None, what: str = ""
    ) -> list: ...


def held_whole(param: torch.nn.Parameter) -> AbstractContextManager[Any]:
    """`PolicyRank.gathered` without ZeRO-3: every rank holds each parameter whole, there is nothing to gather."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class PolicyRank:
    """What a sender knows of the policy rank that hosts it (PolicyActor builds it)."""

    module: torch.nn.Module  # the trained transformers model: its named_parameters() are the weights, HF-named
    rank: int
    world_size: int
    zero3: bool  # ZeRO-3 partitions every parameter: every rank takes part in gathering each one
    # `with gathered(param):` holds the whole of `param` on this rank. Under ZeRO-3 every rank must enter it for each
    # parameter in the same order: DeepSpeed's GatheredParameters, which the rank passes in (a sender's module is
    # imported by the driver too, which must not load DeepSpeed)
    gathered: Callable[[torch.nn.Parameter], AbstractContextManager[Any]] = held_whole
    # The weights the engines serve, as (HF name, tensor), one at a time (under ZeRO-3 every rank iterates, in the
    # same order), and the (name, parameter) pairs they come from, in that order (a sync announces names, dtypes and
    # shapes first). None: the module's own parameters; a LoRA rank passes its merged view (actors/lora.py)
    named_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None
    weight_params: Callable[[], list[tuple[str, torch.nn.Parameter]]] | None = None

    def __post_init__(self) -> None:
        if self.zero3 and self.gathered is held_whole:
            raise ValueError("a ZeRO-3 policy rank must pass its gather (DeepSpeed's GatheredParameters) as `gathered`")

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight the engines serve, whole, one at a time; a tensor is valid until the next is asked for."""
        if self.named_weights is not None:
            yield from self.named_weights()
            return
        for name, param in self.module.named_parameters():
            with self.gathered(param):
                yield name, param.data

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of what `weights` yields, in its order."""
        return self.weight_params() if self.weight_params is not None else list(self.module.named_parameters())


class RankSender:
    """A sync method's side on each policy rank. The rank builds it on the method's first call and keeps it;
    the driver runs one of its public methods on every rank at once (`WeightSync.on_policy`), in the order the
    group submits all its calls, so the ranks meet in the same collectives."""

    def __init__(self, host: PolicyRank):
        self.host = host

    def run(self, op: str, *args: Any) -> Any:
        """`op(*args)` on this sender; its public methods are its operations."""
        method = None if op.startswith("_") or op == "run" else getattr(self, op, None)
        if not callable(method):
            raise AttributeError(f"{type(self).__name__} (policy rank {self.host.rank}) has no operation {op!r}")
        return method(*args)

    def close(self) -> None:
        """Release what the sender holds (a group, a store); it may be opened again."""


class EngineGate:
    """The sync's `engine_lock`. `with gate:` is exclusive: a sync writing into the engines, or a batch generation
    (`--rollout.mode batch`). In `--rollout.mode stream` every group in flight holds a share instead
    (`try_share` / `unshare`, which never block: the producer runs them in its event loop), and a sync that waits for
    the gate admits no new share, so the engines drain and the sync goes in between two groups (vLLM's "wait")."""

    def __init__(self, timeout_s: float = 3600.0):
        # a sync waits at most this long for the gate: the longest a generation or a group in flight may take
        # (the trainer sets --rollout.generate_timeout_s plus a margin)
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._exclusive = False
        self._waiting = 0
        self._shares = 0

    def acquire(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            self._waiting += 1
            try:
                while self._exclusive or self._shares:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"the engines' gate: waited {self.timeout_s:g} s for "
                            + (f"{self._shares} group(s) in flight to finish" if self._shares else "a generation")
                            + " before changing the engines' weights (--rollout.generate_timeout_s)"
                        )
                    self._cv.wait(timeout=min(left, 5.0))
            finally:
                self._waiting -= 1
            self._exclusive = True

    def release(self) -> None:
        with self._cv:
            self._exclusive = False
            self._cv.notify_all()

    def __enter__(self) -> EngineGate:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def try_share(self) -> bool:
        """A share for one group in flight, unless a sync holds the gate or waits for it."""
        with self._cv:
            if self._exclusive or self._waiting:
                return False
            self._shares += 1
            return True

    def unshare(self) -> None:
        with self._cv:
            self._shares -= 1
            self._cv.notify_all()


class WeightSyncTimeoutError(TimeoutError):
    """An engine did not finish loading new weights in time (hung, busy on a long call, or starved of CPU)."""


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


# A call on the policy ranks from the producer thread (an engine restarted mid-generation needs the weights again)
# runs after any training step the trainer thread has started there: each rank runs its calls in order. Such a
# call's deadline allows for that step; the trainer passes --train.step_timeout_s, others get this.
POLICY_BUSY_S = 300.0


class WeightSync(ABC):
    """One run's weight sync between `policy` and the engines of `rollout`. Building it attaches it to the rollout
    group as the group's way back for restarted engines (`engine_back`): the newest sync built for a group is its
    sync. `max_chunk_mb`: the chunks a restarted engine is reloaded through, whatever the method (object_store.py)."""

    method: ClassVar[str]  # its --sync.method name (its key in factory.py's SYNC_METHODS)
    sender: ClassVar[type[RankSender] | None] = None  # its side on the policy ranks, if it runs code there

    def __init__(
        self,
        rollout: Engines,
        policy: Policy | None,
        *,
        timeout_s: float = 120.0,
        max_chunk_mb: float = DEFAULT_MAX_CHUNK_MB,
        policy_busy_s: float = POLICY_BUSY_S,
    ):
        self.rollout, self.policy, self.timeout_s, self.max_chunk_mb = rollout, policy, timeout_s, max_chunk_mb
        self.policy_busy_s = policy_busy_s
        self.engine_lock = EngineGate()
        self.metrics: dict[str, float] = {}  # timings a sync on the trainer thread measured, logged with its step
        rollout.weight_sync = self

    @property
    def policy_deadline_s(self) -> float:
        """The deadline of a call on the policy ranks that may wait behind a training step: the sync's own timeout
        plus `policy_busy_s`, the longest a step may run (the trainer passes `--train.step_timeout_s`)."""
        return self.timeout_s + self.policy_busy_s

    def on_policy(self, op: str, *args: Any, timeout_s: float, what: str) -> list:
        """Run operation `op` of this method's sender on every policy rank; their answers, in rank order. Raises
        TimeoutError naming the policy group, `op` and `what` (what the call waits for) once `timeout_s` has passed
        (actors/group.py `ActorGroup.wait`); both are required, so that no sync waits without a deadline."""
        return self.policy.wait(self.on_policy_async(op, *args), f"{self.method}.{op}", timeout_s=timeout_s, what=what)

    def on_policy_async(self, op: str, *args: Any) -> list[ray.ObjectRef]:
        """`on_policy` without the wait: one ref per rank, for a caller that waits on them with the engines'."""
        return self.policy.call_all_async("sync", self.method, op, *args)

    def load_everywhere(self, calls: list[ray.ObjectRef], kept: Any, version: int, what: str) -> None:
        """Wait for every engine's load call of the sync to `version` (`what`, e.g. "weight sync to policy version
        3"), then record it: `self.synced` = (`kept`, the copy a restarted engine is reloaded from; version), and the
        engines' version. An engine that dies meanwhile does not fail the sync: the others must still finish within
        `timeout_s`, and the dead ones are reloaded from `kept` once Ray has restarted them (`engine_back`, through
        the rollout group's `recover`)."""
        deadline = time.time() + self.timeout_s
        dead: list[tuple[int, str]] = []  # (engine, the error its call raised)
        try:
            wait_for_sync(calls, [], what, self.timeout_s)
        except ray.exceptions.RayActorError:
            stalled = []
            for i, call in enumerate(calls):
                try:
                    ray.get(call, timeout=max(0.0, deadline - time.time()))
                except ray.exceptions.RayActorError as e:
                    dead.append((i, type(e).__name__))
                except ray.exceptions.GetTimeoutError:
                    stalled.append(i)
            if stalled:
                raise WeightSyncTimeoutError(
                    f"{what} timed out after {self.timeout_s:.1f} s: rollout engine(s) {stalled} of {len(calls)} did "
                    f"not finish loading, and engine(s) {[i for i, _ in dead]} died"
                ) from None
        self.synced, self.rollout.version = (kept, version), version
        for i, name in dead:
            self.rollout.recover(i, f"died during the {what} ({name})", died=True)

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
