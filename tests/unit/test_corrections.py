"""study/corrections.py on synthetic inputs whose answers are computed here independently: the count distribution
reconstructed from a pass@k ladder, the exact bootstrap over prompts and samples, Welch's t against a base with its
own error, the task's answer distribution and the chance pass@k, the KL-Cov log ratio and the staleness scan."""

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from entropy_openrlhf.data.arith_task import generate
from study import corrections as c


def pass_at_k_by_hand(n: int, correct: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) with exact integers."""
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def ladder_of(counts: list[int], n: int, ks: list[int]) -> dict[int, float]:
    return {k: float(np.mean([pass_at_k_by_hand(n, x, k) for x in counts])) for k in ks}


def test_the_reconstructed_counts_reproduce_the_ladder_and_have_the_maximum_entropy_form():
    n, ks = 16, [1, 2, 4, 8, 16]
    counts = [0, 0, 0, 1, 1, 2, 3, 5, 8, 8, 12, 16, 16, 4, 0, 1]
    logged = ladder_of(counts, n, ks)
    w = c.max_entropy_counts(logged, n)
    assert w.shape == (n + 1,) and w.min() > 0 and w.sum() == pytest.approx(1.0, abs=1e-12)
    g = np.array([[pass_at_k_by_hand(n, x, k) for x in range(n + 1)] for k in ks])
    assert g @ w == pytest.approx([logged[k] for k in ks], abs=1e-9)
    # the maximum-entropy distribution under these means is exp(l0 + sum_k l_k g_k(c)): log w lies in that span
    design = np.column_stack([np.ones(n + 1), g.T])
    coef, *_ = np.linalg.lstsq(design, np.log(w), rcond=None)
    assert np.abs(design @ coef - np.log(w)).max() < 1e-6
    # and no other distribution with the same means has more entropy: mixing in a direction that keeps the means
    # (the null space of [1; G]) lowers it
    null = np.linalg.svd(design.T)[2][design.shape[1] :]
    entropy = -(w * np.log(w)).sum()
    for direction in null[:3]:
        other = w + 1e-3 * direction / np.abs(direction).max() * w.min()
        assert -(other * np.log(other)).sum() < entropy


def test_a_ladder_no_count_distribution_gives_is_refused():
    with pytest.raises(ValueError, match="no count distribution"):
        c.max_entropy_counts({1: 0.5, 2: 0.3}, 4)  # pass@2 can never be below pass@1


def test_the_bootstrap_sd_is_the_two_stage_resampling_counted_by_hand_and_by_simulation():
    n, k, prompts = 4, 2, 6
    w = np.array([0.3, 0.1, 0.2, 0.15, 0.25])
    g = [pass_at_k_by_hand(n, x, k) for x in range(n + 1)]

    def binom(x: int, p: float) -> float:
        return math.comb(n, x) * p**x * (1 - p) ** (n - x)

    first = [sum(binom(x, cc / n) * g[x] for x in range(n + 1)) for cc in range(n + 1)]
    second = [sum(binom(x, cc / n) * g[x] ** 2 for x in range(n + 1)) for cc in range(n + 1)]
    mean = sum(wi * f for wi, f in zip(w, first))
    both = (sum(wi * s for wi, s in zip(w, second)) - mean**2) / prompts
    within = sum(wi * (s - f**2) for wi, s, f in zip(w, second, first)) / prompts
    m = sum(wi * gi for wi, gi in zip(w, g))
    got = c.bootstrap_sd(w, n, k, prompts)
    assert got.prompts_and_samples == pytest.approx(math.sqrt(both), rel=1e-10)
    assert got.samples_only == pytest.approx(math.sqrt(within), rel=1e-10)
    assert got.upper_bound == pytest.approx(math.sqrt(m * (1 - m) / prompts), rel=1e-12)
    assert got.samples_only < got.prompts_and_samples <= got.upper_bound
    # the resampling itself: draw prompts' counts from w, then each prompt's n responses with replacement
    rng = np.random.default_rng(0)
    reps = 200_000
    cs = rng.choice(n + 1, size=(reps, prompts), p=w)
    resampled = rng.binomial(n, cs / n)
    values = np.array(g)[resampled].mean(axis=1)
    assert values.std() == pytest.approx(got.prompts_and_samples, rel=0.01)


def test_minus_a_base_with_its_own_error_is_welch_t_and_without_error_the_one_sample_t():
    x = np.array([0.47, 0.52, 0.41, 0.45, 0.50, 0.44, 0.49])
    base, base_sd = 0.58, 0.03
    got = c.minus_constant("x", x, base, base_sd)
    v = x.var(ddof=1) / x.size
    se = math.sqrt(v + base_sd**2)
    df = (v + base_sd**2) ** 2 / (v**2 / (x.size - 1))
    assert got.df == pytest.approx(df, rel=1e-12)
    assert (got.low, got.high) == pytest.approx(
        (x.mean() - base - stats.t.ppf(0.975, df) * se, x.mean() - base + stats.t.ppf(0.975, df) * se), abs=1e-12
    )
    assert got.t_p == pytest.approx(2 * stats.t.sf(abs(x.mean() - base) / se, df), rel=1e-10)
    exact = c.minus_constant("x", x, base, 0.0)
    assert exact.df == pytest.approx(x.size - 1)
    assert exact.t_p == pytest.approx(stats.ttest_1samp(x, base).pvalue, rel=1e-10)
    assert exact.t_p == pytest.approx(exact.uncorrected_p, rel=1e-10)
    assert (exact.low, exact.high) == pytest.approx((exact.uncorrected.low, exact.uncorrected.high), abs=1e-12)
    assert got.t_p > exact.t_p and got.high - got.low > exact.high - exact.low  # the base's error widens it


@pytest.mark.parametrize("level", [1, 3])
def test_the_answer_distribution_is_what_the_generator_draws(level):
    q = c.answer_distribution(level)
    assert sum(q.values()) == pytest.approx(1.0, abs=1e-12)
    draws = 20_000
    counts = Counter(int(r["label"]) for r in generate(draws, split="test", seed=7, levels=[level]))
    assert set(counts) <= set(q)  # the generator never gives an answer the enumeration rules out
    for answer, p in q.items():
        sd = math.sqrt(p * (1 - p) / draws)
        assert abs(counts.get(answer, 0) / draws - p) < 5 * sd + 2 / draws, answer


def test_the_train_and_test_answer_distributions_differ_by_the_split():
    test, train = c.answer_distribution(1, "test"), c.answer_distribution(1, "train")
    assert test != train and sum(train.values()) == pytest.approx(1.0)


def test_chance_pass_at_k_by_hand():
    q = {1: 0.5, 2: 0.3, 3: 0.2}
    answers = [1, 1, 3, 7]  # 7 is never guessed
    for k in (1, 2, 5):
        want = ((1 - 0.5**k) * 2 + (1 - 0.8**k) + 0.0) / 4
        assert c.chance_pass_at_k(answers, q, k) == pytest.approx(want, abs=1e-12)
        assert c.expected_chance(q, k) == pytest.approx(
            0.5 * (1 - 0.5**k) + 0.3 * (1 - 0.7**k) + 0.2 * (1 - 0.8**k), abs=1e-12
        )
    assert c.chance_pass_at_k(answers, q, 1) == pytest.approx((0.5 + 0.5 + 0.2) / 4)  # pass@1 = mean q(answer)


def test_the_log_ratio_over_a_subset_of_seeds_by_hand():
    grpo = {1: 0.2, 2: 0.1, 3: 0.3, 4: 0.25, 5: 0.15}
    kl = {1: 0.5, 2: 0.4, 3: 0.2, 4: 0.6, 5: 0.45}
    got = c.log_ratio(grpo, kl, [2, 3, 4, 5])
    d = np.log([kl[s] / grpo[s] for s in (2, 3, 4, 5)])
    half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert (got.estimate.mean, got.estimate.low, got.estimate.high) == pytest.approx(
        (d.mean(), d.mean() - half, d.mean() + half), abs=1e-12
    )
    assert got.t_p == pytest.approx(stats.ttest_1samp(d, 0).pvalue, rel=1e-10)
    assert got.sign_p == pytest.approx(stats.binomtest(3, 4).pvalue) and got.above == 3
    assert got.difference.mean == pytest.approx(np.mean([kl[s] - grpo[s] for s in (2, 3, 4, 5)]))


def write(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "metrics.jsonl"


def test_staleness_zero_after_the_first_step_is_found(tmp_path):
    key = c.STALENESS_KEY
    resumed = write(tmp_path / "a_seed1", [{"step": s, key: 0.0 if s in (0, 3) else 1.0} for s in range(6)])
    plain = write(tmp_path / "b_seed1", [{"step": s, key: 0.0 if s == 0 else 1.0} for s in range(6)])
    write(tmp_path / "c_seed1", [{"step": s} for s in range(3)])  # no staleness logged
    assert c.staleness_zero_steps(resumed) == [3] and c.staleness_zero_steps(plain) == []
    want = "Runs trained at staleness 0 at a step after their first: 1 of 3: a_seed1 (step 3)"
    assert c.staleness_section(tmp_path) == want


def test_the_committed_runs_resumed_with_a_staleness_0_step_are_the_fourteen_listed():
    runs = sorted((Path(__file__).parents[2] / c.RUNS).glob("*/metrics.jsonl"))
    found = {p.parent.name for p in runs if c.staleness_zero_steps(p)}
    assert len(found) == 14 and {"explore_grpo_seed1", "kl_cov_seed5"} <= found


def test_the_base_models_counts_are_reconstructed_per_source_from_its_logged_ladder():
    n, ks = 8, [1, 2, 4, 8]
    counts = {"arith_l3": [0, 1, 2, 8, 8, 5], "arith_l4": [0, 0, 0, 1, 3, 0]}
    logged = {f"eval/{src}/pass@{k}": v for src, cs in counts.items() for k, v in ladder_of(cs, n, ks).items()}
    logged.update({"eval/pass@1": 0.3, "eval/arith_l3/pass@1_ci95_low": 0.1, "eval/arith_l3/maj@8": 0.5})
    found = c.base_counts(logged, ["arith_l3", "arith_l4"])
    for src, (w, got_n) in found.items():
        assert got_n == n
        g = np.array([[pass_at_k_by_hand(n, x, k) for x in range(n + 1)] for k in ks])
        assert g @ w == pytest.approx([ladder_of(counts[src], n, ks)[k] for k in ks], abs=1e-9)


def test_the_run_sets_are_the_ones_the_notebook_names():
    def count(arms):
        return sum(len(seeds) for seeds in arms.values())

    assert (count(c.FIRST_RUNS), count(c.LATER_RUNS), count(c.EXPLORE_RUNS)) == (15, 19, 14)
    first = {(arm, s) for arm, seeds in c.FIRST_RUNS.items() for s in seeds}
    later = {(arm, s) for arm, seeds in c.LATER_RUNS.items() for s in seeds}
    assert not first & later  # the later runs played no part in finding the correlation
