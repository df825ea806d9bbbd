"""The driver's asyncio view of the streaming engines (`--rollout.mode stream|partial`): `await engines.generate(r)`
sends one token-id request to the least busy engine and returns its `TokenResult` once the engine has finished it.

Each engine has two tasks here: one sends what was asked of it (`submit`, every request that came since its last
send in one call), one fetches what it finished (`poll`, which waits in the engine up to POLL_S). An engine that
dies is brought back by the rollout group (`RolloutGroup.recover`: Ray restarts it, the weight sync reloads it) and
every request it held is sent to it again from the start with the same seed (`resubmitted`); the caller sees only
the result. Every wait has a deadline: a request that has not come back within `--rollout.generate_timeout_s`
raises TimeoutError naming the engine and the request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from entropy_openrlhf.actors.engine_stream import TokenRequest, TokenResult

if TYPE_CHECKING:  # annotations only
    from entropy_openrlhf.actors.rollout import RolloutGroup

log = logging.getLogger(__name__)

POLL_S = 0.5  # how long one poll waits in the engine for a finished request
ANSWER_S = 120.0  # beyond its own wait, how long a submit or poll may take to answer before the engine counts as hung


@dataclass
class _Engine:
    actor: Any
    waiting: dict[str, tuple[TokenRequest, asyncio.Future]] = field(default_factory=dict)  # sent or to send
    outbox: list[TokenRequest] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: asyncio.Task | None = None  # one recovery at a time: its sender and its fetcher both see a death
    incarnation: int = 0  # recoveries so far: a call made before the last one failed with the process it went to
    polling: Any = None  # the poll call in flight (an ObjectRef): closing waits for it (StreamEngines.__aexit__)


class StreamEngines:
    """Requests to the rollout group's engines, one sample each (module docstring). Use inside one event loop:
    `async with StreamEngines(group) as engines: ...`."""

    def __init__(self, group: RolloutGroup, *, timeout_s: float | None = None):
        self.group = group
        self.timeout_s = timeout_s if timeout_s is not None else group.generate_timeout_s
        self.engines = [_Engine(actor) for actor in group.actors]
        self.resubmitted = 0  # requests sent again after their engine died
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    async def __aenter__(self) -> StreamEngines:
        for i in range(len(self.engines)):
            self._tasks += [asyncio.create_task(self._send(i)), asyncio.create_task(self._fetch(i))]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        # Leaving on an error the run is ending: a hung engine (a stalled sync froze it) would hold the error up to
        # ANSWER_S at each wait below, and no next client needs them, so nothing is waited for (aborts still sent).
        failing = exc[0] is not None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in self.engines:
            # a poll still running in the engine would take the results of whoever sends requests next (another
            # StreamEngines, within POLL_S): wait for it to answer; what it brings back was this client's
            if engine.polling is not None and not failing:
                try:
                    await asyncio.wait_for(engine.polling, timeout=POLL_S + ANSWER_S)
                except Exception as e:  # noqa: BLE001 - closing; an engine that is gone holds nothing
                    log.warning("closing the streaming engines: the last poll failed: %s", e)
        for engine in self.engines:  # nothing waits for them any more: free the engines
            if engine.waiting and failing:
                engine.actor.abort.remote(list(engine.waiting))
            elif engine.waiting:
                try:
                    await asyncio.wait_for(engine.actor.abort.remote(list(engine.waiting)), timeout=ANSWER_S)
                except Exception as e:  # noqa: BLE001 - closing; an engine that is gone holds nothing
                    log.warning("closing the streaming engines: abort failed: %s", e)
            for _, future in engine.waiting.values():
                future.cancel()

    def in_flight(self) -> int:
        return sum(len(e.waiting) for e in self.engines)

    async def generate(self, request: TokenRequest) -> TokenResult:
        """`request`'s result, from the engine with the fewest requests in flight."""
        i = min(range(len(self.engines)), key=lambda k: len(self.engines[k].waiting))
        engine = self.engines[i]
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        engine.waiting[request.request_id] = (request, future)
        engine.outbox.append(request)
        engine.wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            engine.actor.abort.remote([request.request_id])  # its answer does not matter: the request is given up
            raise TimeoutError(
                f"rollout engine {i}: request {request.request_id} did not finish within "
                f"--rollout.generate_timeout_s {self.timeout_s:g}"
            ) from None
        finally:
            engine.waiting.pop(request.request_id, None)

    async def _send(self, i: int) -> None:
        engine = self.engines[i]
        while True:
            await engine.wake.wait()
            engine.wake.clear()
            batch, engine.outbox = engine.outbox, []
            batch = [r for r in batch if r.request_id in engine.waiting]  # a caller that timed out is gone
            if not batch:
                continue
            sent_to = engine.incarnation
            try:
                await asyncio.wait_for(engine.actor.submit.remote(batch), timeout=ANSWER_S)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
                await self._recover(i, f"failed while taking {len(batch)} request(s) ({type(e).__name__})", sent_to)

    async def _fetch(self, i: int) -> None:
        engine = self.engines[i]
        while True:
            if not engine.waiting:
                await asyncio.sleep(0.01)
                continue
            asked = engine.incarnation
            try:
                engine.polling = engine.actor.poll.remote(POLL_S)
                results = await asyncio.wait_for(engine.polling, timeout=POLL_S + ANSWER_S)
                engine.polling = None
            except ray.exceptions.RayActorError as e:
                engine.polling = None
                await self._recover(i, f"died while generating ({type(e).__name__})", asked)
                continue
            except asyncio.TimeoutError:
                engine.polling = None
                if asked == engine.incarnation:
                    ray.kill(engine.actor, no_restart=False)  # a hang becomes a death, which Ray restarts
                await self._recover(i, f"did not answer a poll within {POLL_S + ANSWER_S:.0f} s", asked)
                continue
            for result in results:
                entry = engine.waiting.get(result.request_id)
                if entry is not None and not entry[1].done():
                    entry[1].set_result(result)

    async def _recover(self, i: int, why: str, incarnation: int) -> None:
        """Engine `i` died (or hung): wait until Ray has restarted it and the sync has reloaded it (in a thread: the
        group's recover blocks, with its own deadlines), then send it everything it held again. A second caller
        while that runs waits for the same recovery; a call made to an `incarnation` already recovered from failed
        with that process, and what it carried has been sent again."""
        if self._closing:
            return
        engine = self.engines[i]
        if engine.incarnation != incarnation and (engine.recovering is None or engine.recovering.done()):
            return
        if engine.recovering is None or engine.recovering.done():
            engine.recovering = asyncio.create_task(self._bring_back(i, why))
        await asyncio.shield(engine.recovering)

    async def _bring_back(self, i: int, why: str) -> None:
        engine = self.engines[i]
        await asyncio.get_running_loop().run_in_executor(None, self.group.recover, i, why, True)
        engine.incarnation += 1
        again = [request for request, future in engine.waiting.values() if not future.done()]
        self.resubmitted += len(again)
        engine.outbox = again + [r for r in engine.outbox if r.request_id not in {x.request_id for x in again}]
        engine.wake.set()
        log.warning("rollout engine %d is back: %d request(s) sent to it again", i, len(again))


def engine_idle_frac(before: list[dict[str, float]], after: list[dict[str, float]]) -> float:
    """The share of wall time the engines had nothing in flight between two readings of their `stream_stats`,
    averaged over the engines (rollout/engine_idle_frac)."""
    shares = []
    for b, a in zip(before, after):
        elapsed = a["elapsed_s"] - b["elapsed_s"]
        if elapsed > 0:
            shares.append(min(1.0, max(0.0, (a["idle_s"] - b["idle_s"]) / elapsed)))
    return sum(shares) / len(shares) if shares else 0.0


def read_stream_stats(group: RolloutGroup, timeout_s: float = ANSWER_S) -> list[dict[str, float]]:
    """Every engine's `stream_stats`, in engine order. Raises TimeoutError naming the engines that did not answer."""
    refs = [actor.stream_stats.remote() for actor in group.actors]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [k for k, ref in enumerate(refs) if ref in pending]
        raise TimeoutError(f"rollout engine(s) {late} did not answer stream_stats within {timeout_s:.0f} s")
    return ray.get(refs, timeout=timeout_s)  # all done by now
