"""DAPO's dynamic sampling in the trainer (`--algo.dynamic_sampling`): groups whose rewards are all equal are dropped
and more rounds are generated until the batch is full or `--algo.max_gen_batches` rounds were made; the step's
`reward/*` metrics cover every response generated in it, all rounds, as if scored at once."""

import random
import statistics
import threading

import pytest

from entropy_openrlhf.actors.reward import RewardGroup
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.batches import merge_reward_metrics
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.rollouts import RolloutRequest
from entropy_openrlhf.samples import PromptItem, Sample


def numbered(engines, request: RolloutRequest) -> list[list[Sample]]:
    """Sample j of prompt p answers "p-j": the reward below reads the numbers."""
    return [
        [Sample(p.index, p.prompt, [1], f"{p.index}-{j}", [5, 6], [-0.5, -0.5], p.label, request.policy_version)
         for j in range(request.n)]
        for p in request.prompts
    ]  # fmt: skip


def verdict(prompt: int, j: int) -> dict:
    """Prompts 0, 3, 6 ... are always right, 1, 4, 7 ... always wrong (no signal), 2, 5, 8 ... right on odd samples.
    Sample 0 of prompt 4 timed out; every response logs its prompt's number."""
    right = {0: True, 1: False, 2: j % 2 == 1}[prompt % 3]
    return {"reward": float(right), "acc": right, "format_ok": True, "error": "", "timed_out": (prompt, j) == (4, 0),
            "logs": {"prompt_number": float(prompt)}}  # fmt: skip


class Reward:
    """Scores by `verdict` and reports the round's metrics with the reward group's own code."""

    def score(self, samples: list[Sample]):
        results = []
        for s in samples:
            prompt, j = map(int, s.response.split("-"))
            r = verdict(prompt, j)
            s.reward, s.acc, s.format_ok = r["reward"], r["acc"], r["format_ok"]
            results.append(r)
        return samples, RewardGroup._metrics(self, results, seconds=0.1 * len(results))


class Sync:
    engine_lock = threading.Lock()
    engine_version = 0

    def make_current(self) -> float:
        return 0.0


class Engines:
    restarts = 0


def trainer(max_gen_batches: int, dynamic: bool = True) -> Trainer:
    cfg = from_args(
        ["--rollout.function", f"{__name__}:numbered", "--data.shuffle", "false", "--rollout.batch_size", "2",
         "--rollout.n_samples_per_prompt", "2", "--algo.dynamic_sampling", str(dynamic).lower(),
         "--algo.max_gen_batches", str(max_gen_batches)]
    )  # fmt: skip
    items = [PromptItem(i, f"<prompt {i}>", "x") for i in range(12)]
    t = Trainer(cfg, "unused", items, [])
    t.rollout, t.reward, t.reference, t.sync = Engines(), Reward(), None, Sync()
    return t


def test_groups_without_signal_are_replaced_from_further_rounds():
    t = trainer(max_gen_batches=5)
    batch = t._make_batch(0)
    # round 1: prompts 0, 1 (both without signal); round 2: 2 (kept), 3; round 3: 4, 5 (kept): full after 3 rounds
    assert [g[0].prompt_index for g in batch.groups] == [2, 5]
    assert batch.metrics["rollout/gen_rounds"] == 3
    assert batch.metrics["rollout/dynamic_kept_frac"] == pytest.approx(2 / 6)
    assert t.stream.offset == 6  # the next step starts after the prompts this one used
    # the reward metrics are those of the 12 responses generated, computed here over all of them at once
    generated = [verdict(p, j) for p in range(6) for j in range(2)]
    rewards = [r["reward"] for r in generated]
    assert batch.metrics["reward/mean"] == pytest.approx(statistics.fmean(rewards))
    assert batch.metrics["reward/std"] == pytest.approx(statistics.pstdev(rewards))
    assert batch.metrics["reward/acc"] == pytest.approx(statistics.fmean(float(r["acc"]) for r in generated))
    assert batch.metrics["reward/timeouts"] == 1.0  # in round 3: the first round's metrics alone would say 0
    assert batch.metrics["reward/prompt_number"] == pytest.approx(2.5)  # the first round alone: 0.5
    assert batch.metrics["reward/seconds_per_sample"] == pytest.approx(0.1)


def test_after_the_last_round_the_batch_is_topped_up_with_groups_without_signal():
    batch = trainer(max_gen_batches=2)._make_batch(0)
    assert [g[0].prompt_index for g in batch.groups] == [2, 0]  # kept first, then the first dropped
    assert batch.metrics["rollout/gen_rounds"] == 2
    assert batch.metrics["reward/mean"] == pytest.approx(5 / 8)  # prompts 0-3: 1 1, 0 0, 0 1, 1 1


def test_without_dynamic_sampling_one_round_is_trained_whatever_its_rewards():
    t = trainer(max_gen_batches=5, dynamic=False)
    batch = t._make_batch(0)
    assert [g[0].prompt_index for g in batch.groups] == [0, 1]
    assert "rollout/gen_rounds" not in batch.metrics and t.stream.offset == 2
    assert batch.metrics["reward/mean"] == 0.5 and batch.metrics["reward/std"] == 0.5


def round_metrics(values: list[float], timeouts: int) -> dict[str, float]:
    return {"reward/mean": statistics.fmean(values), "reward/std": statistics.pstdev(values),
            "reward/timeouts": float(timeouts), "reward/errors": 0.0}  # fmt: skip


def test_merged_rounds_equal_the_metrics_of_all_their_responses():
    rng = random.Random(0)
    rounds = [[rng.gauss(0.3, 1.0) for _ in range(n)] for n in (16, 5, 9)]
    merged = merge_reward_metrics([(len(v), round_metrics(v, i)) for i, v in enumerate(rounds)])
    everything = [x for v in rounds for x in v]
    assert merged["reward/mean"] == pytest.approx(statistics.fmean(everything), rel=1e-12)
    assert merged["reward/std"] == pytest.approx(statistics.pstdev(everything), rel=1e-12)
    assert merged["reward/timeouts"] == 0 + 1 + 2 and merged["reward/errors"] == 0


def test_a_metric_one_round_lacks_is_the_mean_over_the_rounds_that_logged_it():
    merged = merge_reward_metrics([(4, {"reward/x": 1.0}), (2, {}), (6, {"reward/x": 0.5})])
    assert merged == {"reward/x": pytest.approx((4 * 1.0 + 6 * 0.5) / 10)}


def test_one_round_is_its_own_metrics():
    one = round_metrics([0.0, 1.0, 1.0], 2)
    assert merge_reward_metrics([(3, one)]) == one
