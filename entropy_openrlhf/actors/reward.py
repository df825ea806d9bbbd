"""The reward actor group: verifier workers that score samples, isolating whatever the verifier does.

Failure handling, from cheap to drastic:
- an exception in the verifier: that sample scores 0 (`reward/errors`), inside the worker;
- a hang: the per-sample deadline (SIGALRM: actor tasks run on the worker's main thread when max_concurrency is 1)
  scores it 0 (`reward/timeouts`) and the worker carries on;
- a worker that dies (segfault, os._exit, OOM kill): Ray restarts it and its batch is retried once; if it dies
  again the batch is re-scored one sample per task, so only the sample that kills the worker scores 0;
- a worker stuck where no signal reaches it (C code holding the GIL): past a generous budget the group kills it
  (Ray restarts it) and re-scores the batch one sample per task, so only the stuck sample times out.
Every sample gets exactly one result in the output (a retried batch replaces its failed attempt), but the verifier
may run on a sample more than once: a retry starts its batch again from the first sample (docs/guides/verifiers.md).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import ray

from entropy_openrlhf.ray_waits import wait_started
from entropy_openrlhf.samples import Sample
from rewards import VerifierLoadError, load_verifier
from rewards.loader import Item, failed_result

if TYPE_CHECKING:  # annotations only: the verifier workers need no config module
    from entropy_openrlhf.config import Config

logger = logging.getLogger(__name__)

# extra wall time a batch gets beyond 2x its per-sample deadlines before the group declares the worker stuck
STUCK_GRACE_S = 30.0
# how long a restarting worker may take before the group goes on without it
RESTART_LIMIT_S = 120.0


@ray.remote(max_restarts=-1, max_task_retries=0)  # retries are the group's: it knows which batch died
class VerifierWorker:
    def __init__(self, spec: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.load_error = None
        try:
            self.verifier = load_verifier(spec)
        except Exception as e:  # noqa: BLE001 - reported by ready(), not by a restart loop
            self.load_error = f"{type(e).__name__}: {e}"

    def ready(self) -> str | None:
        return self.load_error

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def score(self, items: list[tuple]) -> list[dict[str, Any]]:
        return self.verifier.score(items, self.timeout_s)


def verifier_items(samples: list[Sample], tokenizer: Any = None) -> list[Item]:
    """What a verifier is called with for each sample: (response, label, prompt, metadata), the metadata being the
    dataset row's other fields (its `data_source` included) plus the response's token count and the engine's finish
    reason ("stop" or "length": cut at --rollout.max_new_tokens), so a verifier can judge length itself
    (docs/guides/verifiers.md). With the policy's `tokenizer` (an OpenRLHF reward file's run), each item also holds
    the query OpenRLHF gives its reward_func: the prompt and response tokens decoded together, special tokens kept, so
    the end-of-turn token the response stopped at is in it (the response text itself is decoded without them)."""
    items: list[Item] = []
    for s in samples:
        metadata = {**s.metadata, "data_source": s.data_source, "response_tokens": len(s.response_token_ids),
                    "finish_reason": s.finish_reason}  # fmt: skip
        item = (s.response, s.label, s.prompt, metadata)
        if tokenizer is not None:
            item += (tokenizer.decode(s.prompt_token_ids + s.response_token_ids, skip_special_tokens=False),)
        items.append(item)
    return items


class RewardGroup:
    """`num_workers` verifier actors. `score` splits a batch across them and returns the samples in the order given,
    with `reward`, `acc`, `format_ok` and `reward_info` filled, plus the batch's `reward/*` metrics."""

    @classmethod
    def from_config(cls, cfg: Config, model_path: str | None = None) -> RewardGroup:
        """The verifier group a run's config describes (--reward.*, --ray.start_timeout_s), as training starts it;
        `model_path`: the policy's folder, whose tokenizer builds an OpenRLHF reward file's queries."""
        w = cfg.reward
        return cls(
            w.verifier, num_workers=w.num_workers, timeout_s=w.timeout_s, num_cpus_per_worker=w.num_cpus_per_worker,
            custom_resources=w.custom_resources, start_timeout_s=cfg.ray.start_timeout_s, tokenizer_path=model_path,
        )  # fmt: skip

    def __init__(
        self,
        verifier: str,
        *,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        num_cpus_per_worker: float = 0.25,
        custom_resources: dict[str, float] | None = None,
        stuck_grace_s: float = STUCK_GRACE_S,
        start_timeout_s: float = 600.0,
        tokenizer_path: str | None = None,
    ):
        # load here first: a clear error in the driver, and file paths made absolute for the workers
        loaded = load_verifier(verifier)
        self.spec = loaded.spec
        self.tokenizer = None  # an OpenRLHF reward file's queries are decoded here, on the driver (verifier_items)
        if loaded.batched and tokenizer_path is not None:
            # imported here: the verifier workers import this module too, and need no transformers
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.timeout_s = timeout_s
        self.stuck_grace_s = stuck_grace_s
        self._lock = threading.Lock()  # one score() at a time; the driver calls it from a background thread
        # SPREAD: on a multi-node cluster the verifier load goes to every node rather than piling onto one
        self.workers = [
            VerifierWorker.options(
                num_cpus=num_cpus_per_worker, resources=custom_resources or None, scheduling_strategy="SPREAD"
            ).remote(self.spec, timeout_s)
            for _ in range(num_workers)
        ]
        try:
            ready = wait_started([w.ready.remote() for w in self.workers], "the reward group", start_timeout_s)
        except TimeoutError:
            self.shutdown()
            raise
        errors = [e for e in ready if e]
        if errors:
            self.shutdown()
            raise VerifierLoadError(f"verifier {verifier!r} does not load in a worker: {errors[0]}")

    def score(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        if not samples:
            return samples, {}
        with self._lock:
            start = time.monotonic()
            items = verifier_items(samples, self.tokenizer)
            results = self._score_items(items)
            seconds = time.monotonic() - start
        for sample, r in zip(samples, results):
            sample.reward, sample.acc, sample.format_ok = r["reward"], r["acc"], r["format_ok"]
            sample.reward_info = {**r["info"], "timed_out": r["timed_out"], "error": r["error"]}
        return samples, self._metrics(results, seconds)

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []

    # ------------------------------------------------------------------------------------------------ internals

    def _budget(self, n: int) -> float:
        return self.stuck_grace_s + 2 * self.timeout_s * n

    def _score_items(self, items: list[tuple]) -> list[dict[str, Any]]:
        """Units of work are (start, end, attempt) ranges of `items`; each worker runs at most one unit at a time,
        so a worker's death is blamed on exactly one unit."""
        n = len(items)
        results: list[dict[str, Any] | None] = [None] * n
        k = min(len(self.workers), n)
        bounds = [round(i * n / k) for i in range(k + 1)]
        queue = deque((bounds[i], bounds[i + 1], 0) for i in range(k))
        free = list(range(len(self.workers)))
        running: dict[ray.ObjectRef, tuple[int, int, int, int, float]] = {}

        def failed(start: int, end: int, attempt: int, reason: str, stuck: bool) -> None:
            if not stuck and attempt == 0:
                queue.append((start, end, 1))  # a worker death: retry the same batch once
            elif end - start > 1:
                queue.extend((i, i + 1, 0) for i in range(start, end))  # isolate the culprit
            else:
                results[start] = failed_result(error=None if stuck else reason, timed_out=stuck)

        while queue or running:
            if not free and not running:  # every worker is gone: fail what is left rather than wait forever
                for start, end, _ in queue:
                    for i in range(start, end):
                        results[i] = failed_result(error="no verifier worker left")
                break
            while queue and free:
                start, end, attempt = queue.popleft()
                w = free.pop(0)
                ref = self.workers[w].score.remote(items[start:end])
                running[ref] = (w, start, end, attempt, time.monotonic() + self._budget(end - start))
            wait_s = max(0.0, min(deadline for *_, deadline in running.values()) - time.monotonic())
            done, _ = ray.wait(list(running), num_returns=1, timeout=wait_s)
            for ref in done:
                w, start, end, attempt, _ = running.pop(ref)
                try:
                    results[start:end] = ray.get(ref)
                    free.append(w)
                except Exception as e:  # noqa: BLE001 - worker died, or the batch could not be sent back
                    first_line = (str(e).splitlines() or [""])[0][:300]
                    where = f"samples {start}-{end - 1}, attempt {attempt + 1}"
                    logger.warning("reward worker %d failed on %s: %s", w, where, first_line)
                    failed(
                        start, end, attempt, f"the verifier worker failed twice on it: {type(e).__name__}", stuck=False
                    )
                    if self._wait_alive(w):
                        free.append(w)
            now = time.monotonic()
            for ref, (w, start, end, attempt, deadline) in list(running.items()):
                if now >= deadline:
                    budget = self._budget(end - start)
                    logger.warning(
                        "reward worker %d stuck on samples %d-%d for %.0f s: restart", w, start, end - 1, budget
                    )
                    running.pop(ref)
                    ray.kill(self.workers[w], no_restart=False)
                    failed(start, end, attempt, "", stuck=True)
                    if self._wait_alive(w):
                        free.append(w)
        return results  # type: ignore[return-value]

    def _wait_alive(self, w: int) -> bool:
        """Block until Ray has restarted worker `w`: a task sent to a restarting actor fails without running, and
        would be blamed on an innocent batch."""
        give_up = time.monotonic() + RESTART_LIMIT_S
        while time.monotonic() < give_up:
            try:
                ray.get(self.workers[w].ready.remote(), timeout=max(0.1, give_up - time.monotonic()))
                return True
            except ray.exceptions.RayActorError:
                time.sleep(0.2)
            except ray.exceptions.GetTimeoutError:
                break
        logger.error("reward worker %d is not back after %.0f s; going on without it", w, RESTART_LIMIT_S)
        return False

    def _metrics(self, results: list[dict[str, Any]], seconds: float) -> dict[str, float]:
        rewards = [r["reward"] for r in results]
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            n = len(results)
            logger.warning(
                "reward: the verifier failed on %d of %d samples; first error: %s", len(errors), n, errors[0]
            )
        metrics = {
            "reward/mean": statistics.fmean(rewards),
            "reward/std": statistics.pstdev(rewards),
            "reward/acc": statistics.fmean(float(r["acc"]) for r in results),
            "reward/format_rate": statistics.fmean(float(r["format_ok"]) for r in results),
            "reward/timeouts": float(sum(r["timed_out"] for r in results)),
            "reward/errors": float(len(errors)),
            "reward/scored_frac": statistics.fmean(not (r["error"] or r["timed_out"]) for r in results),
            "reward/seconds_per_sample": seconds / len(results),
        }
        logs: dict[str, list[float]] = {}
        for r in results:
            for name, value in r["logs"].items():
                logs.setdefault(name, []).append(value)
        for name, values in logs.items():
            metrics[f"reward/{name}"] = statistics.fmean(values)
        return metrics
