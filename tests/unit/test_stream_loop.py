"""StreamLoop's bookkeeping over a scripted stand-in for vLLM's LLMEngine (the real engine: the integration test
tests/integration/test_streaming_engine.py): versions per token, resending on a new adapter, the stale prefix cache,
a failing engine, and idle time."""

import threading
import time
from types import SimpleNamespace

import pytest

from entropy_openrlhf.actors.engine_stream import StreamLoop, TokenRequest


class ScriptedEngine:
    """Each step emits one token per running request: token = 100 + the request's step count, log-prob -0.5; a
    request ends at its max_tokens ("length"). Records what was added and aborted."""

    def __init__(self, fail_at_step: int | None = None, cached_tokens: int = 0):
        self.running: dict[str, dict] = {}
        self.added: list[tuple[str, list[int], int, int | None, object]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_at_step, self.cached_tokens = fail_at_step, cached_tokens
        self.reset_ok = True
        self.go = threading.Event()
        self.go.set()

    def add_request(self, rid, prompt, params, lora_request=None):
        self.added.append((rid, prompt["prompt_token_ids"], params.max_tokens, params.seed, lora_request))
        self.running[rid] = {"left": params.max_tokens, "first": True}

    def abort_request(self, ids):
        for rid in ids:
            self.aborted.append(rid)
            self.running.pop(rid, None)

    def reset_prefix_cache(self, reset_running_requests=False):
        return self.reset_ok or reset_running_requests

    def step(self):
        self.go.wait(timeout=10)
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("engine core died")
        outs = []
        for rid, state in list(self.running.items()):
            state["left"] -= 1
            done = state["left"] == 0
            completion = SimpleNamespace(
                token_ids=[100 + self.steps], text="x", logprobs=[{100 + self.steps: SimpleNamespace(logprob=-0.5)}],
                finish_reason="length" if done else None,
            )  # fmt: skip
            cached = self.cached_tokens if state["first"] else 0
            state["first"] = False
            outs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=done, num_cached_tokens=cached))
            if done:
                del self.running[rid]
        return outs


class GatedLock:
    """The engine lock, with the stream loop's thread let in only as often as the test says (`tick`): one entry is
    one admission and one engine step, so a test can load weights between two given steps."""

    def __init__(self):
        self.lock, self.ticks = threading.RLock(), threading.Semaphore(0)

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.ticks.release()

    def __enter__(self):
        if threading.current_thread().name.endswith("stream loop"):
            assert self.ticks.acquire(timeout=10), "the test never let the loop step"
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def steps_to(engine, lock, n):
    lock.tick(n - engine.steps)
    deadline = time.monotonic() + 10
    while engine.steps < n:
        assert time.monotonic() < deadline, f"the loop did not reach step {n}"
        time.sleep(0.001)


def make_loop(engine, version, gated=False, **kwargs):
    lock = GatedLock() if gated else threading.RLock()
    params = lambda r: SimpleNamespace(max_tokens=r.max_new_tokens, seed=r.seed)  # noqa: E731
    return StreamLoop(engine, params, lock=lock, version=lambda: version[0], **kwargs), lock


def collect(loop, n):
    got, deadline = {}, time.monotonic() + 10
    while len(got) < n:
        assert time.monotonic() < deadline, "the loop did not finish its requests within 10 s"
        for r in loop.poll(1.0):
            got[r.request_id] = r
    return got


def test_tokens_carry_the_version_of_the_step_that_sampled_them_and_keep_counts_stale_kv():
    engine, version = ScriptedEngine(), [0]
    loop, lock = make_loop(engine, version, gated=True)
    try:
        loop.submit([TokenRequest("a", [1, 2], 6, seed=5), TokenRequest("b", [3], 2, seed=6)])
        steps_to(engine, lock, 3)
        with lock:  # a load between steps 3 and 4, as the engine does it
            version[0] = 1
            loop.after_load(1, 0)
        lock.tick(100)
        got = collect(loop, 2)
    finally:
        lock.tick(100)
        loop.close()
    a, b = got["a"], got["b"]
    assert a.versions == [0, 0, 0, 1, 1, 1]
    assert a.stale_kv_tokens == 3  # keep: every token after the load saw the old KV
    assert b.versions == [0, 0] and b.stale_kv_tokens == 0 and b.finish_reason == "length"
    assert a.log_probs == [-0.5] * 6 and len(a.token_ids) == 6


def test_a_new_adapter_resends_each_request_as_its_continuation_with_a_seed_of_its_own():
    engine, version = ScriptedEngine(), [0]
    adapter = ["old"]
    loop, lock = make_loop(engine, version, gated=True, adapter=lambda: adapter[0])
    try:
        loop.submit([TokenRequest("a", [1, 2], 5, seed=9), TokenRequest("b", [3], 3, seed=None)])
        steps_to(engine, lock, 2)
        with lock:
            version[0], adapter[0] = 1, "new"
            loop.after_load(1, 0, new_adapter=True)
        lock.tick(100)
        got = collect(loop, 2)
    finally:
        lock.tick(100)
        loop.close()
    a, b = got["a"], got["b"]
    assert a.versions == [0, 0, 1, 1, 1] and a.finish_reason == "length" and a.stale_kv_tokens == 0  # recomputed
    assert sorted(engine.aborted) == ["a", "b"]
    resent = {x[0]: x[1:] for x in engine.added if "#" in x[0]}
    assert resent["a#1"] == ([1, 2, *a.token_ids[:2]], 3, resent["a#1"][2], "new")
    assert resent["a#1"][2] not in (None, 9)  # a seed of its own
    assert resent["b#1"] == ([3, *b.token_ids[:2]], 1, None, "new")  # unseeded stays unseeded
    assert b.versions == [0, 0, 1]


def test_a_keep_load_the_prefix_cache_could_not_drop_marks_later_cache_hits_stale():
    """While running requests hold cached blocks vLLM cannot reset the cache: a request admitted then that hits the
    cache may read blocks of the old weights, so its tokens count as stale (an upper bound) until a reset."""
    engine, version = ScriptedEngine(cached_tokens=4), [0]
    loop, lock = make_loop(engine, version)
    try:
        loop.submit([TokenRequest("a", [1, 2], 8)])
        deadline = time.monotonic() + 10
        while engine.steps < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with lock:
            engine.reset_ok = False
            version[0] = 1
            loop.after_load(1, 0)
            loop.submit([TokenRequest("c", [1, 2, 3], 3)])
        got = collect(loop, 2)
        engine.reset_ok = True
        loop.submit([TokenRequest("d", [1], 2)])  # the engine ran dry and reset its cache meanwhile
        got.update(collect(loop, 1))
    finally:
        loop.close()
    assert got["c"].versions == [1, 1, 1] and got["c"].stale_kv_tokens == 3
    assert got["d"].stale_kv_tokens == 0


def test_an_engine_that_fails_fails_every_caller_naming_it():
    loop, _ = make_loop(ScriptedEngine(fail_at_step=2), [0], name="rollout engine 3")
    try:
        loop.submit([TokenRequest("a", [1], 5)])
        with pytest.raises(RuntimeError, match="rollout engine 3: its stream loop failed.*engine core died"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                loop.poll(0.5)
        with pytest.raises(RuntimeError, match="rollout engine 3"):
            loop.submit([TokenRequest("b", [1], 5)])
    finally:
        loop.close()


def test_idle_time_counts_only_time_with_nothing_in_flight():
    engine = ScriptedEngine()
    loop, _ = make_loop(engine, [0])
    try:
        time.sleep(0.2)
        idle = loop.stats()
        assert idle["idle_s"] >= 0.15 and idle["in_flight"] == 0
        engine.go.clear()
        loop.submit([TokenRequest("a", [1], 1)])
        time.sleep(0.2)  # in flight (its step is held): not idle
        busy = loop.stats()
        assert busy["in_flight"] == 1 and busy["idle_s"] - idle["idle_s"] < 0.15
        engine.go.set()
        collect(loop, 1)
    finally:
        loop.close()


def test_bad_partial_kv_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--rollout.partial_kv 'drop'"):
        make_loop(ScriptedEngine(), [0], partial_kv="drop")
