"""The driver's pool of sandbox workers (`--tools.num_workers` actors of worker_actor.py, reserved like the reward
pool: `--tools.num_cpus_per_worker` CPUs and `--tools.custom_resources` each, spread over the nodes).

`await pool.run(code, stdin)` runs one tool call on a free worker and always returns a `SandboxResult`: what the
code printed, or an error observation (`exit_code` -1, the reason in `stderr`) when the call could not give one.
A rollout's coroutines call it from one event loop, many at once; each worker runs one call at a time, the others
wait for a free one. `pool.run_many(calls)` does the same from synchronous code.

Every wait has a deadline, and its error names what was waited for:
- for a free worker: `queue_timeout_s` (then a timed-out observation naming the queue);
- for a call's answer: `--tools.timeout_s` (the sandbox's own limit, inside the worker) plus `answer_grace_s`;
  a worker past it is stuck (not the code: the sandbox kills that) and is replaced;
- for a new worker's start: `start_timeout_s` (--ray.start_timeout_s).
A worker that dies (its process killed, its node lost) gives the call it held an error observation and is replaced
by a fresh actor before the slot serves again; the pool keeps serving on the others meanwhile. Only the call the
worker held sees the failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import ray

from entropy_openrlhf.ray_waits import wait_started
from entropy_openrlhf.tools.sandbox import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PROCESSES,
    SandboxResult,
    SandboxUnavailableError,
)
from entropy_openrlhf.tools.worker_actor import SandboxWorker

if TYPE_CHECKING:  # annotations only
    from entropy_openrlhf.config import Config

log = logging.getLogger(__name__)

ANSWER_GRACE_S = 30.0  # beyond --tools.timeout_s, how long a worker may take to answer before it counts as stuck
QUEUE_TIMEOUT_S = 3600.0  # how long a call may wait for a free worker


def error_result(why: str, *, timed_out: bool = False, seconds: float = 0.0) -> SandboxResult:
    """The observation of a call that gave no result of its own: `why` in stderr, exit code -1."""
    return SandboxResult(stdout="", stderr=why, exit_code=-1, timed_out=timed_out, truncated=False, seconds=seconds)


class ToolPool:
    """`num_workers` sandbox workers and the calls to them (module docstring). Start it before the rollouts; it
    fails closed: a worker whose node cannot run the sandbox stops the start with the reason."""

    @classmethod
    def from_config(cls, cfg: Config) -> ToolPool:
        t = cfg.tools
        return cls(
            num_workers=t.num_workers, sandbox=t.sandbox, timeout_s=t.timeout_s, memory_mb=t.memory_mb,
            max_output_bytes=t.max_output_bytes, max_processes=t.max_processes,
            num_cpus_per_worker=t.num_cpus_per_worker, custom_resources=t.custom_resources,
            start_timeout_s=cfg.ray.start_timeout_s,
        )  # fmt: skip

    def __init__(
        self,
        *,
        num_workers: int = 2,
        sandbox: str = "bwrap",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_processes: int = DEFAULT_MAX_PROCESSES,
        num_cpus_per_worker: float = 0.5,
        custom_resources: dict[str, float] | None = None,
        start_timeout_s: float = 600.0,
        answer_grace_s: float = ANSWER_GRACE_S,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
    ):
        self.settings = {"sandbox": sandbox, "timeout_s": timeout_s, "memory_mb": memory_mb,
                         "max_output_bytes": max_output_bytes, "max_processes": max_processes}  # fmt: skip
        self.timeout_s = timeout_s
        self.answer_grace_s = answer_grace_s
        self.queue_timeout_s = queue_timeout_s
        self.start_timeout_s = start_timeout_s
        self._options = {"num_cpus": num_cpus_per_worker, "resources": custom_resources or None,
                         "scheduling_strategy": "SPREAD", "max_concurrency": 1}  # fmt: skip
        self.workers: list = [self._spawn() for _ in range(num_workers)]
        try:
            reasons = wait_started([w.ready.remote() for w in self.workers], "the tool pool", start_timeout_s)
        except TimeoutError:
            self.shutdown()
            raise
        errors = [r for r in reasons if r]
        if errors:
            self.shutdown()
            raise SandboxUnavailableError(
                f"--tools.sandbox {sandbox}: the sandbox cannot start on a tool worker's node: {errors[0]}; give "
                "--tools.sandbox none to run tool calls unisolated (docs/guides/tools.md)"
            )
        self._free: deque[int] = deque(range(num_workers))
        self._waiters: deque[asyncio.Future] = deque()
        self._gone: set[int] = set()  # slots whose replacement failed: they serve no more
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "worker_failures": 0, "replaced": 0}
        self.seconds = 0.0

    # ------------------------------------------------------------------------------------------------ calls

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        """One tool call's result, or its error observation; never raises for what the code or a worker does."""
        start = time.monotonic()
        slot = await self._acquire()
        if slot is None:
            if len(self._gone) == len(self.workers):
                why = f"tool call not run: no sandbox worker left (all {len(self.workers)} lost; see the log)"
            else:
                why = (f"tool call not run: no sandbox worker became free within {self.queue_timeout_s:g} s "
                       f"({len(self._gone)} of {len(self.workers)} workers lost)")  # fmt: skip
            return self._count(error_result(why, timed_out=True), start)
        ok = True
        try:
            result, ok = await self._call(slot, code, stdin)
        finally:
            if not ok:
                ok = await self._replace(slot)
            self._release(slot, ok)
        return self._count(result, start)

    def run_many(self, calls: list[str | tuple[str, str]]) -> list[SandboxResult]:
        """`run` for each of `calls` (code, or (code, stdin)), at once, from synchronous code; in their order."""

        async def all_of() -> list[SandboxResult]:
            return await asyncio.gather(*(self.run(*((c,) if isinstance(c, str) else c)) for c in calls))

        return asyncio.run(all_of())

    def stats(self) -> dict[str, float]:
        """Counts since the start: calls, errors (non-zero exit, timeout or truncation), timeouts, worker failures,
        workers replaced, and the mean seconds per call (the wait for a free worker included)."""
        n = self.counts["calls"]
        return {**{k: float(v) for k, v in self.counts.items()}, "seconds_mean": self.seconds / n if n else 0.0}

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []

    # ------------------------------------------------------------------------------------------------ internals

    def _spawn(self):
        return SandboxWorker.options(**self._options).remote(self.settings)

    def _count(self, result: SandboxResult, start: float) -> SandboxResult:
        self.counts["calls"] += 1
        self.counts["errors"] += not result.ok
        self.counts["timeouts"] += result.timed_out
        self.seconds += time.monotonic() - start
        return result

    async def _call(self, slot: int, code: str, stdin: str) -> tuple[SandboxResult, bool]:
        """(the result, whether worker `slot` is still sound)."""
        worker = self.workers[slot]
        answer_s = self.timeout_s + self.answer_grace_s
        start = time.monotonic()
        try:
            return await asyncio.wait_for(worker.run.remote(code, stdin), timeout=answer_s), True
        except asyncio.TimeoutError:
            why = (
                f"tool call failed: sandbox worker {slot} did not answer within {answer_s:g} s (--tools.timeout_s "
                f"{self.timeout_s:g} + {self.answer_grace_s:g} s); the worker is replaced"
            )
            timed_out = True
        except ray.exceptions.RayActorError as e:
            why = f"tool call failed: sandbox worker {slot} died during it ({type(e).__name__}); it is replaced"
            timed_out = False
        except ray.exceptions.RayTaskError as e:  # the worker raised (the sandbox could not start): it stays
            first = (str(e.cause if e.cause is not None else e).splitlines() or [""])[0][:300]
            return error_result(f"tool call failed in sandbox worker {slot}: {first}"), True
        log.warning("%s", why)
        self.counts["worker_failures"] += 1
        return error_result(why, timed_out=timed_out, seconds=time.monotonic() - start), False

    async def _replace(self, slot: int) -> bool:
        """Kill worker `slot` and start a fresh one in its place; False when the new one does not start."""
        try:
            ray.kill(self.workers[slot], no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self.workers[slot] = self._spawn()
        try:
            reason = await asyncio.wait_for(self.workers[slot].ready.remote(), timeout=self.start_timeout_s)
        except asyncio.TimeoutError:
            reason = f"it did not start within {self.start_timeout_s:g} s (--ray.start_timeout_s)"
        except ray.exceptions.RayActorError as e:
            reason = f"it died starting ({type(e).__name__})"
        if reason:
            log.error("sandbox worker %d could not be replaced: %s; the pool goes on without it", slot, reason)
            return False
        self.counts["replaced"] += 1
        log.warning("sandbox worker %d replaced", slot)
        return True

    async def _acquire(self) -> int | None:
        if self._free:
            return self._free.popleft()
        if len(self._gone) == len(self.workers):
            return None
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            return await asyncio.wait_for(future, timeout=self.queue_timeout_s)
        except asyncio.TimeoutError:
            # a slot handed over as the deadline passed is not lost (asyncio.wait_for may drop it on 3.11)
            if future.done() and not future.cancelled():
                return future.result()
            return None
        finally:
            if future in self._waiters:
                self._waiters.remove(future)

    def _release(self, slot: int, ok: bool) -> None:
        if not ok:
            self._gone.add(slot)
            if len(self._gone) == len(self.workers):
                for waiter in self._waiters:  # nothing will serve them: fail them now rather than at the deadline
                    if not waiter.done():
                        waiter.set_result(None)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._free.append(slot)
