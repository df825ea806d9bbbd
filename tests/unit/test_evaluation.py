"""The evaluation protocol's routing and arithmetic (pipeline/evaluation.py), with stand-ins for the rollout and
reward groups: which prompts are sampled and how often, which are greedy, how accuracies are averaged, and pass@k /
maj@n against counts made by brute force. The real groups run it in tests/integration/test_evaluation.py."""

import itertools
import math
import random

import numpy as np
import pytest

from entropy_openrlhf.algorithms.metrics import bootstrap_interval, majority_correct, pass_at_k, pass_at_k_ladder
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.evaluation import evaluate
from entropy_openrlhf.pipeline.run_notes import eval_due
from entropy_openrlhf.samples import PromptItem, Sample


class RecordingRollout:
    """Answers `n` responses per prompt and records each call's sampling settings."""

    def __init__(self, answers: dict[int, list[str]] | None = None):
        self.calls = []
        self.answers = answers

    @staticmethod
    def sample(p, response: str, policy_version: int) -> Sample:
        return Sample(p.index, p.prompt, [1], response, [7], [0.0], p.label, policy_version, data_source=p.data_source)

    def generate(self, items, *, n, temperature, top_p, max_new_tokens, seed, policy_version):
        self.calls.append({"sources": [p.data_source for p in items], "n": n, "temperature": temperature})
        if self.answers is not None:  # prompt index -> the n responses it gets
            return [self.sample(p, r, policy_version) for p in items for r in self.answers[p.index][:n]]
        return [
            Sample(
                prompt_index=p.index,
                prompt=p.prompt,
                prompt_token_ids=[1],
                response=f"r{j}",
                response_token_ids=[7] * (j + 1),
                rollout_log_probs=[0.0] * (j + 1),
                label=p.label,
                policy_version=policy_version,
                data_source=p.data_source,
            )  # fmt: skip
            for p in items
            for j in range(n)
        ]


class LabelIsAnswer:
    """Marks a response correct when it equals the label, so a test chooses each prompt's outcome."""

    def score(self, samples):
        for s in samples:
            s.acc = s.response == s.label
            s.reward_info = {"pred": s.response or None}  # "" = no answer extracted
        return samples, {}


def item(index: int, source: str, label: str) -> PromptItem:
    return PromptItem(index, f"q{index}", label, source, {})


def test_with_one_sample_competition_sources_are_sampled_and_the_rest_greedy():
    items = [item(0, "AIME", "r0"), item(1, "math", "r0"), item(2, "amc", "r0"), item(3, "aime25", "r0")]
    rollout = RecordingRollout()
    out = evaluate(rollout, LabelIsAnswer(), items, from_args([]))
    assert rollout.calls == [
        {"sources": ["math"], "n": 1, "temperature": 0.0},
        {"sources": ["AIME", "amc", "aime25"], "n": 1, "temperature": 0.6},
    ]
    assert not [k for k in out if "pass@" in k or "maj@" in k]  # one sample: no pass@k to report


def test_with_n_samples_every_source_is_sampled_once_at_eval_temperature_and_greedy_stays():
    cfg = from_args(["--eval.n_samples", "4", "--eval.temperature", "1.0"])
    items = [item(0, "AIME", "r0"), item(1, "math", "r0"), item(2, "amc", "r0"), item(3, "aime25", "r0")]
    rollout = RecordingRollout()
    evaluate(rollout, LabelIsAnswer(), items, cfg)
    assert rollout.calls == [
        {"sources": ["math"], "n": 1, "temperature": 0.0},
        {"sources": ["AIME", "math", "amc", "aime25"], "n": 4, "temperature": 1.0},
    ]


def test_avg_at_k_per_source_and_the_average_over_sources_not_samples():
    cfg = from_args(["--eval.n_samples", "4"])
    # aime: one of four samples matches ("r2") -> avg@4 = 0.25; math (greedy, one sample "r0"): 2 of 3 right;
    # rows without a data_source are grouped as "default"
    items = [
        item(0, "aime", "r2"),
        item(1, "math", "r0"), item(2, "math", "r0"), item(3, "math", "wrong"),
        item(4, "", "r0"),
    ]  # fmt: skip
    out = evaluate(RecordingRollout(), LabelIsAnswer(), items, cfg)
    assert out["eval/aime/acc"] == 0.25
    assert abs(out["eval/math/acc"] - 2 / 3) < 1e-12
    assert out["eval/default/acc"] == 1.0
    assert abs(out["eval/acc"] - (0.25 + 2 / 3 + 1.0) / 3) < 1e-12
    # with n = 4 every prompt is also sampled (responses of 1..4 tokens); four greedy responses of 1 token
    assert out["eval/response_len"] == (5 * (1 + 2 + 3 + 4) + 4 * 1) / (5 * 4 + 4)


def test_no_prompts_no_metrics():
    rollout = RecordingRollout()
    assert evaluate(rollout, LabelIsAnswer(), [], from_args([])) == {}
    assert rollout.calls == []


# ----------------------------------------------------------------------------------------------- pass@k, maj@n


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n responses (c of them correct) that hold a correct one, counted."""
    responses = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(responses[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_is_the_brute_force_count(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_thousands_of_samples():
    # against exact integer binomials (Python ints do not overflow)
    for n, c, k in [(2000, 3, 1000), (5000, 1, 1), (5000, 10, 64), (4096, 4000, 2048), (3000, 0, 7)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0
        got = pass_at_k(n, c, k)
        assert got == pytest.approx(exact, rel=1e-9, abs=1e-12) and 0.0 <= got <= 1.0
    assert pass_at_k(5000, 1, 1) == pytest.approx(1 / 5000)  # pass@1 is the share correct


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 1, 0), (4, -1, 1), (4, 5, 1), (4, 1, 1.0), (4, True, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_the_k_ladder_doubles_up_to_n():
    assert pass_at_k_ladder(1) == [1]
    assert pass_at_k_ladder(16) == [1, 2, 4, 8, 16]
    assert pass_at_k_ladder(12) == [1, 2, 4, 8, 12]


def test_majority_vote_counts_answers_and_breaks_ties_by_the_first_given():
    assert majority_correct(["7", "8", "7", None], [True, False, True, False]) is True
    assert majority_correct(["8", "7", "8", "7"], [False, True, False, True]) is False  # tie: "8" came first
    assert majority_correct(["7", "8", "8", "7"], [True, False, False, True]) is True
    assert majority_correct([None, "", None], [False, False, False]) is False  # nobody answered


def test_pass_at_k_maj_and_intervals_per_source_and_averaged():
    n = 4
    # responses per prompt; the label of every prompt is "y"
    answers = {
        0: ["y", "n", "n", "n"],  # math: 1 of 4
        1: ["n", "n", "n", "n"],  # math: 0 of 4
        2: ["y", "y", "y", "n"],  # math: 3 of 4, majority right
        3: ["n", "y", "n", ""],  # aime: 1 of 4, majority "n" wrong
        4: ["y", "x", "x", "y"],  # aime: 2 of 4, tie y/x: y came first
    }
    items = [item(i, "math", "y") for i in range(3)] + [item(3, "aime", "y"), item(4, "aime", "y")]
    cfg = from_args(["--eval.n_samples", str(n), "--eval.bootstrap", "2000"])
    rollout = RecordingRollout(answers)  # greedy answers are each prompt's first response: math right, wrong, right
    out = evaluate(rollout, LabelIsAnswer(), items, cfg)
    counts = {"math": [1, 0, 3], "aime": [1, 2]}
    for src, cs in counts.items():
        for k in (1, 2, 4):
            want = sum(brute_force_pass_at_k(n, c, k) for c in cs) / len(cs)
            assert out[f"eval/{src}/pass@{k}"] == pytest.approx(want), (src, k)
    assert out["eval/pass@2"] == pytest.approx((out["eval/math/pass@2"] + out["eval/aime/pass@2"]) / 2)
    assert out["eval/math/maj@4"] == pytest.approx(1 / 3)  # only prompt 2's majority is right
    assert out["eval/aime/maj@4"] == pytest.approx(1 / 2)  # prompt 4's tie goes to "y"
    assert out["eval/maj@4"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    # the protocols side by side: math's acc is greedy (2 of 3), aime's is avg@4 (3 of 8)
    assert out["eval/math/acc"] == pytest.approx(2 / 3) and out["eval/aime/acc"] == pytest.approx(3 / 8)
    for name in ("pass@1", "pass@4"):
        for prefix in ("eval/math/", "eval/aime/", "eval/"):
            low, high = out[f"{prefix}{name}_ci95_low"], out[f"{prefix}{name}_ci95_high"]
            assert low <= out[f"{prefix}{name}"] <= high, (prefix, name)
    assert out["eval/aime/pass@4_ci95_low"] == out["eval/aime/pass@4_ci95_high"] == 1.0  # both prompts solved
    assert out["eval/pass@1_ci95_low"] < out["eval/pass@1_ci95_high"]
    assert "eval/pass@2_ci95_low" not in out  # intervals for pass@1 and pass@n only
    # each prompt's correct count, per source in prompt-index order: the counts the pass@k above were made from
    assert out["eval/math/correct_counts"] == counts["math"] and out["eval/aime/correct_counts"] == counts["aime"]
    assert "eval/correct_counts" not in out  # per source only: prompts of two sources are not one list


def test_correct_counts_follow_the_prompt_index_whatever_order_the_responses_come_in():
    # the engines may return the groups in any order; the counts are listed by prompt index, and what the record
    # keeps is enough to recompute every pass@k it reports
    n = 3
    answers = {5: ["y", "y", "n"], 2: ["n", "n", "n"], 9: ["y", "y", "y"], 7: ["n", "y", "n"]}

    class Shuffled(RecordingRollout):
        def generate(self, items, **kw):
            out = super().generate(items, **kw)
            random.Random(3).shuffle(out)
            return out

    items = [item(i, "arith_l3", "y") for i in (9, 2, 7, 5)]  # not in index order either
    out = evaluate(Shuffled(answers), LabelIsAnswer(), items, from_args(["--eval.n_samples", str(n)]))
    assert out["eval/arith_l3/correct_counts"] == [0, 2, 1, 3]  # prompts 2, 5, 7, 9
    for k in (1, 2, 3):
        want = np.mean([brute_force_pass_at_k(n, c, k) for c in out["eval/arith_l3/correct_counts"]])
        assert out[f"eval/arith_l3/pass@{k}"] == pytest.approx(want)


def test_bootstrap_interval_covers_the_truth_about_95_percent_of_the_time():
    # prompts whose pass@1 is 1 with probability 0.3: the interval of the mean of 40 should hold 0.3 in ~95 %
    rng = random.Random(0)
    hits = 0
    for trial in range(200):
        values = [float(rng.random() < 0.3) for _ in range(40)]
        low, high = bootstrap_interval([values], resamples=1000, seed=trial)
        hits += low <= 0.3 <= high
    assert 0.88 <= hits / 200 <= 0.99


def test_bootstrap_of_constant_values_is_a_point():
    assert bootstrap_interval([[0.5] * 10, [1.0] * 3]) == (0.75, 0.75)


@pytest.mark.parametrize("initial", [True, False])
def test_eval_schedule_every_n_versions_and_version_0_only_when_asked(initial):
    due = [v for v in range(0, 51) if eval_due(v, 25, initial)]
    assert due == ([0, 25, 50] if initial else [25, 50])
    assert not any(eval_due(v, 0, initial) for v in range(5))  # every 0: evaluation off


def test_bootstrap_interval_is_the_exact_2_5_and_97_5_percentiles_of_its_resampled_means():
    # Fixed data and seed; the resampled means recomputed here one by one. What must match the function: numpy's
    # Generator(seed) drawing, group after group, a (resamples, prompts) array of prompt indices with replacement.
    groups = [[0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], [0.25, 0.5, 0.75, 1.0, 0.0]]
    resamples, seed = 400, 11
    rng = np.random.default_rng(seed)
    picks = [rng.integers(0, len(g), size=(resamples, len(g))).tolist() for g in groups]
    means = sorted(
        math.fsum(math.fsum(g[i] for i in p[r]) / len(g) for g, p in zip(groups, picks)) / len(groups)
        for r in range(resamples)
    )

    def percentile(q: float) -> float:  # linear interpolation between the order statistics around q (n - 1)
        position = q / 100 * (len(means) - 1)
        below = math.floor(position)
        return means[below] + (position - below) * (means[min(below + 1, len(means) - 1)] - means[below])

    low, high = bootstrap_interval(groups, resamples=resamples, seed=seed)
    assert (low, high) == pytest.approx((percentile(2.5), percentile(97.5)), abs=1e-12)
    # the check tells a 95% interval from a 90% one: those bounds lie strictly inside
    assert low < percentile(5) and percentile(95) < high
    assert bootstrap_interval(groups, resamples=resamples, seed=seed, level=0.9) == pytest.approx(
        (percentile(5), percentile(95)), abs=1e-12
    )
