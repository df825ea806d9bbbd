"""The producer of `--rollout.mode stream|partial`: groups rolled out continuously, a buffer, batches for the trainer.

The trainer's producer thread runs `StreamProducer.run`, one asyncio event loop in which:
- a group coroutine per prompt (`--rollout.function`'s, rollouts/base.py) sends its n requests to the engines
  (rollouts/engines.py) and, once all are back, has them scored (the reward group, in a worker thread); DAPO's filter
  (`--algo.dynamic_sampling`) drops a group whose rewards are all equal as it finishes;
- finished groups wait in a buffer, in the order they finished; the trainer's next batch is the first
  `--rollout.batch_size` of them whose oldest token is no older than `--async.max_staleness` versions behind the step
  it trains at (an older one is dropped and counted, `rollout/dropped_stale_groups`, never trained on);
- new groups are started while fewer than (max_staleness + 1) batches are started and not yet trained, and while the
  engines' weights are recent enough for the step the group will land in: the same bound the batch producer keeps;
- new weights reach the engines as the trainer publishes them: in `partial` mode at once, the engines loading them
  between two steps of their requests (engine_stream.py); in `stream` mode through the sync's gate, which lets no new
  group in while a sync waits, so the engines drain first;
- an evaluation due (`--eval.every`) rolls the held-out prompts out through the same group coroutine and engines,
  beside the training groups, holding a share of the gate so that no sync changes the weights it evaluates;
- every prompt drawn is open until the step that trains its group (or until its group is dropped): a checkpoint
  records the open ones (`open_prompts`), and the resumed run rolls them out again first, from the checkpoint's
  weights and with their own seeds, so it neither skips nor repeats a prompt (docs/guides/streaming.md says what it
  does not repeat).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import traceback
from typing import Any

from transformers import AutoTokenizer

from entropy_openrlhf.actors.engine_settings import prompt_seed
from entropy_openrlhf.pipeline.batches import Batch, merge_reward_metrics
from entropy_openrlhf.pipeline.evaluation import evaluate
from entropy_openrlhf.rollouts import GroupRequest, check_groups, get_group_rollout, group_session
from entropy_openrlhf.rollouts.base import RolloutRequest
from entropy_openrlhf.rollouts.engines import StreamEngines, engine_idle_frac, read_stream_stats
from entropy_openrlhf.samples import PromptItem, Sample

TICK_S = 0.02  # how often the producer looks again at finished groups, new weights and room for more groups


def stream_metrics(groups: list[list[Sample]], step: int) -> dict[str, float]:
    """What token ages a streamed batch holds: staleness of each response token (the trainer is at `step`), the
    share of samples whose tokens span more than one version, the share of tokens sampled on stale KV."""
    ages = [step - v for g in groups for s in g for v in (s.token_versions or [])]
    samples = [s for g in groups for s in g]
    tokens = sum(len(s.response_token_ids) for s in samples)
    return {
        "async/token_staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "async/token_staleness_max": float(max(ages, default=0)),
        "rollout/partial_frac": sum(len(set(s.token_versions or [])) > 1 for s in samples) / max(1, len(samples)),
        "rollout/stale_kv_token_frac": sum(s.stale_kv_tokens for s in samples) / max(1, tokens),
    }


class StreamProducer:
    """One run's streaming producer (module docstring); `run` is the producer thread's body."""

    def __init__(self, trainer: Any):
        """`trainer`: the run's Trainer (pipeline/trainer.py, which imports this module): its groups, sync, prompt
        stream, queue and evaluation bookkeeping."""
        self.t = trainer
        cfg = trainer.cfg
        self.cfg, self.mode = cfg, cfg.rollout.mode
        self.group_fn = get_group_rollout(cfg.rollout.function)
        self.tokenizer = AutoTokenizer.from_pretrained(trainer.model_path)
        self.token_ids: dict[int, list[int]] = {}  # by prompt index: each prompt is tokenised once
        # a multi-turn rollout's session (python_tool's sandbox pool and limits, openrlhf_agent's agent class), in
        # every group request
        self.tools = group_session(cfg, getattr(trainer, "tools", None), self.tokenizer)
        # scored groups, in the order they finished, each with its key and reward metrics
        self.buffer: list[tuple[int, list[Sample], dict[str, float]]] = []
        # the prompts drawn and not yet trained (key: the order they were drawn in), as (epoch, position in the
        # training prompts); the keys of each handed-over batch until its step is trained. The lock: a save on the
        # trainer thread reads them with the stream position while this thread draws.
        self.lock = threading.Lock()
        self.open: dict[int, tuple[int, int]] = {}
        self.batch_keys: dict[int, list[int]] = {}
        self.reopen = list(trainer.reopen)  # from a checkpoint: rolled out before any new prompt
        self.keys = itertools.count()
        self.started = 0  # groups started, not counting those dropped (stale, or all-equal rewards)
        self.dropped_stale = self.dropped_equal = 0
        self.tags = itertools.count()

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            where = f"rollout producer (--rollout.mode {self.mode})"
            failure = RuntimeError(f"{where} failed: {e}\n{traceback.format_exc()}")
            failure.__cause__ = e
            self.t.queue.put(failure)

    async def _main(self) -> None:
        t, cfg = self.t, self.cfg
        loop = asyncio.get_running_loop()
        step = t.start_step
        running: set[asyncio.Task] = set()
        stats = await loop.run_in_executor(None, read_stream_stats, t.rollout)
        async with StreamEngines(t.rollout) as engines:
            self.engines = engines
            syncing: asyncio.Future | None = None
            evaluating: asyncio.Task | None = None
            while step < cfg.train.num_steps and not t.stop.is_set():
                if evaluating is not None and evaluating.done():
                    evaluating.result()
                    evaluating = None
                if evaluating is None and t.eval_wanted(t.sync.engine_version):
                    evaluating = asyncio.create_task(self._evaluate(loop))
                for task in [x for x in running if x.done()]:
                    running.discard(task)
                    task.result()  # a failed group fails the run, with its own error
                if syncing is not None and syncing.done():
                    syncing.result()
                    syncing = None
                if syncing is None and t.latest_version > t.sync.engine_version:
                    syncing = loop.run_in_executor(None, self._make_current)
                while self._room(step) and not t.stop.is_set():
                    if self.mode == "stream" and not t.sync.engine_lock.try_share():
                        break  # a sync waits for the engines to drain
                    self.started += 1  # now, not when the task first runs: _room counts it at once
                    running.add(asyncio.create_task(self._group(*self._draw())))
                batch = self._take_batch(step)
                if batch is not None:
                    after = await loop.run_in_executor(None, read_stream_stats, t.rollout)
                    batch.metrics["rollout/engine_idle_frac"] = engine_idle_frac(stats, after)
                    stats = after
                    await loop.run_in_executor(None, self._reference, batch)
                    await loop.run_in_executor(None, self._hand_over, batch)
                    step += 1
                    continue
                await asyncio.wait(running or {asyncio.ensure_future(asyncio.sleep(TICK_S))}, timeout=TICK_S)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if evaluating is not None:
                await evaluating
            if syncing is not None:
                await syncing

    def _room(self, step: int) -> bool:
        """Whether another group may start: fewer than (max_staleness + 1) batches started and not yet trained, and
        the engines' weights no older than the step this group will land in allows."""
        t, cfg = self.t, self.cfg
        size, lag = cfg.rollout.batch_size, cfg.async_.max_staleness
        trained = t.latest_version - t.start_step  # batches the trainer has finished
        if self.started >= (trained + lag + 1) * size:
            return False
        lands_in = t.start_step + self.started // size
        return t.sync.engine_version >= lands_in - lag

    def _make_current(self) -> None:
        """Worker thread: bring the engines to the newest published weights. `stream`: through the gate, which lets
        no new group in meanwhile and waits for those in flight; `partial`: at once, the engines loading between
        two steps of their requests."""
        if self.mode == "stream":
            with self.t.sync.engine_lock:
                self.t.sync.make_current()
        else:  # only an evaluation holds a share of the gate in partial mode
            with self.t.sync.engine_lock:
                self.t.sync.make_current()

    async def _roll(
        self, prompt: PromptItem, n: int, temperature: float, top_p: float, max_new_tokens: int, seed: int | None
    ) -> list[Sample]:
        """One prompt's group from `--rollout.function`'s coroutine, checked; `seed` the group's."""
        if prompt.index not in self.token_ids:  # the prompt text holds the chat template's special tokens: add none
            self.token_ids[prompt.index] = self.tokenizer(prompt.prompt, add_special_tokens=False)["input_ids"]
        tag = f"g{next(self.tags)}p{prompt.index}"
        request = GroupRequest(
            self.token_ids[prompt.index], n, temperature, top_p, max_new_tokens, seed, tag, tools=self.tools
        )
        samples = await self.group_fn(self.engines, prompt, request)
        check_groups(
            [samples],
            RolloutRequest([prompt], n, temperature, top_p, max_new_tokens, seed, 0),
            self.cfg.rollout.function,
        )
        return samples

    def _draw(self) -> tuple[int, int, PromptItem]:
        """The next prompt to roll out, one a checkpoint left open first: (its key, its epoch, the prompt)."""
        with self.lock:
            epoch, position = self.reopen.pop(0) if self.reopen else self.t.stream.draw()
            key = next(self.keys)
            self.open[key] = epoch, position
        return key, epoch, self.t.stream.items[position]

    def open_prompts(self, version: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        """For a checkpoint after `version` steps, on the trainer thread: the prompt stream's position and the
        prompts drawn but not trained by then (in flight, buffered, or in a batch for a later step), in the order
        they were drawn."""
        with self.lock:
            self._forget_trained(version)
            position = self.t.stream.epoch, self.t.stream.offset
            return position, [*self.open.values(), *self.reopen]

    def _forget_trained(self, version: int) -> None:
        """Close the prompts of the batches for steps before `version` (trained by now). Under the lock."""
        for step in [s for s in self.batch_keys if s < version]:
            for key in self.batch_keys.pop(step):
                self.open.pop(key, None)

    def _close(self, key: int) -> None:
        """A dropped group's prompt: done with, as in an unbroken run (it is not rolled out again)."""
        with self.lock:
            self.open.pop(key, None)

    async def _group(self, key: int, epoch: int, prompt: PromptItem) -> None:
        """One prompt's group: rolled out, scored, filtered, buffered. `epoch`: the stream's when it was drawn."""
        t, cfg = self.t, self.cfg
        r = cfg.rollout
        base = cfg.train.seed * 7919 + epoch * 104_729  # as the batch producer's, per prompt
        try:
            samples = await self._roll(
                prompt,
                r.n_samples_per_prompt,
                r.temperature,
                r.top_p,
                r.max_new_tokens,
                prompt_seed(base, prompt.index),
            )
        finally:
            if self.mode == "stream":
                t.sync.engine_lock.unshare()
        samples, reward_metrics = await asyncio.get_running_loop().run_in_executor(None, t.score_samples, samples)
        if cfg.algo.dynamic_sampling and len({s.reward for s in samples}) <= 1:
            self.dropped_equal += 1  # zero advantage: teaches nothing; another prompt takes its place
            self.started -= 1
            self._close(key)
            return
        self.buffer.append((key, samples, reward_metrics))

    def _take_batch(self, step: int) -> Batch | None:
        """The batch for `step` from the buffer, once it holds enough groups recent enough for it (older ones are
        dropped and counted)."""
        lag = self.cfg.async_.max_staleness
        fresh = []
        for key, group, reward_metrics in self.buffer:
            if min(s.policy_version for s in group) < step - lag:
                self.dropped_stale += 1
                self.started -= 1  # its place in the batch goes to another group
                self._close(key)
            else:
                fresh.append((key, group, reward_metrics))
        self.buffer = fresh
        size = self.cfg.rollout.batch_size
        if len(self.buffer) < size:
            return None
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        with self.lock:
            self._forget_trained(self.t.latest_version)
            self.batch_keys[step] = [key for key, _, _ in taken]
        groups = [g for _, g, _ in taken]
        metrics = merge_reward_metrics([(len(g), m) for _, g, m in taken])  # over the batch's responses
        metrics.update(stream_metrics(groups, step))
        metrics.update({
            "rollout/dropped_stale_groups": float(self.dropped_stale),
            "rollout/dynamic_dropped_groups": float(self.dropped_equal),
            "rollout/resubmitted_requests": float(self.engines.resubmitted),
            "rollout/engine_restarts": float(self.t.rollout.restarts),
            "rollout/in_flight_requests": float(self.engines.in_flight()),
        })  # fmt: skip
        return Batch(step, groups, metrics, (self.t.stream.epoch, self.t.stream.offset))

    async def _evaluate(self, loop: asyncio.AbstractEventLoop) -> None:
        """The evaluation of the weights the engines hold, beside the training groups (module docstring)."""
        t = self.t
        deadline = time.monotonic() + t.sync.engine_lock.timeout_s
        while not t.sync.engine_lock.try_share():  # a sync under way first
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"evaluation: the weight sync held the engines for {t.sync.engine_lock.timeout_s:g} s"
                )
            await asyncio.sleep(TICK_S)
        try:
            version = t.sync.engine_version
            if not t.eval_wanted(version):
                return
            t.evaluated.add(version)
            t0 = time.time()
            engines = StreamedGroups(self, loop)
            result = await loop.run_in_executor(None, evaluate, engines, t.reward, t.test_items, self.cfg)
        finally:
            t.sync.engine_lock.unshare()
        result["time/eval"] = time.time() - t0
        with t._eval_lock:
            t.eval_results.append((version, result))

    def groups_after_run(self) -> GroupsAfterRun:
        """The engines' batch `generate` through the group coroutines once `run` has ended: the final evaluation's
        for a rollout function with no batch form (python_tool)."""
        return GroupsAfterRun(self)

    def _reference(self, batch: Batch) -> None:
        reference = self.t.reference
        if reference is None:
            return
        t0 = time.time()
        flat = [s for g in batch.groups for s in g]
        ref = reference.log_probs([s.prompt_token_ids for s in flat], [s.response_token_ids for s in flat])
        for s, lp in zip(flat, ref):
            s.ref_log_probs = lp
        batch.metrics["time/reference"] = time.time() - t0

    def _hand_over(self, batch: Batch) -> None:
        """Worker thread: into the trainer's queue (it holds at most max_staleness batches), as long as the run goes."""
        while not self.t.stop.is_set():
            try:
                self.t.queue.put(batch, timeout=1.0)
                return
            except queue.Full:
                continue


class StreamedGroups:
    """The engines' batch `generate`, answered by the streaming producer's group coroutines: what evaluation calls
    from a worker thread while the producer's event loop runs the groups."""

    def __init__(self, producer: StreamProducer, loop: asyncio.AbstractEventLoop):
        self.producer, self.loop = producer, loop

    def generate(
        self,
        prompts: list[PromptItem],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None,
        policy_version: int,
    ) -> list[Sample]:
        async def all_groups() -> list[list[Sample]]:
            groups = (
                self.producer._roll(p, n, temperature, top_p, max_new_tokens, prompt_seed(seed, p.index))
                for p in prompts
            )
            return await asyncio.gather(*groups)

        # each request has its own deadline in the engines' client; this one only says what it waited for
        future = asyncio.run_coroutine_threadsafe(all_groups(), self.loop)
        limit = self.producer.engines.timeout_s * 2
        try:
            groups = future.result(timeout=limit)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"evaluation: {len(prompts)} prompt(s) x {n} were not rolled out within {limit:g} s"
            ) from None
        return [s for g in groups for s in g]


class GroupsAfterRun:
    """StreamedGroups once the producer's event loop has ended: each `generate` runs the group coroutines in an event
    loop of its own, over streaming engines of its own (each request keeps its deadline there)."""

    def __init__(self, producer: StreamProducer):
        self.producer = producer

    def generate(
        self,
        prompts: list[PromptItem],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None,
        policy_version: int,
    ) -> list[Sample]:
        producer = self.producer

        async def all_groups() -> list[list[Sample]]:
            async with StreamEngines(producer.t.rollout) as engines:
                producer.engines = engines
                return await asyncio.gather(
                    *(producer._roll(p, n, temperature, top_p, max_new_tokens, prompt_seed(seed, p.index))
                      for p in prompts)
                )  # fmt: skip

        return [s for g in asyncio.run(all_groups()) for s in g]
