"""study/stats.py on synthetic data where the answer is known: partial correlation, the run-level bootstrap, the
paired tests, Holm's correction and the paired t-test's power."""

import math

import numpy as np
import pytest
from scipy import stats
from scipy.stats import binomtest, ttest_1samp, wilcoxon

from study.stats import (
    holm,
    paired_t_power,
    paired_test,
    pairs_for_power,
    partial_interval,
    partial_r,
    pearson,
    pearson_interval,
    run_bootstrap,
    sign_test_p,
    t_test_p,
    wilcoxon_p,
)

Z975 = 1.959964


def closed_form_partial(x, y, z) -> float:
    """r_xy.z = (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2)), from the three pairwise correlations."""
    r = np.corrcoef([x, y, z])
    r_xy, r_xz, r_yz = r[0, 1], r[0, 2], r[1, 2]
    return (r_xy - r_xz * r_yz) / math.sqrt((1 - r_xz**2) * (1 - r_yz**2))


def test_partial_r_matches_the_closed_form():
    rng = np.random.default_rng(0)
    z = rng.normal(size=200)
    x = 0.6 * z + rng.normal(size=200)
    y = -0.4 * x + 0.5 * z + rng.normal(size=200)
    assert partial_r(x, y, z) == pytest.approx(closed_form_partial(x, y, z), abs=1e-12)
    c = partial_interval(x, y, z)
    # Fisher's interval with one variable held fixed: standard error 1 / sqrt(n - 3 - 1)
    half = Z975 / math.sqrt(200 - 4)
    assert c.n == 200 and (c.low, c.high) == pytest.approx(
        (math.tanh(math.atanh(c.r) - half), math.tanh(math.atanh(c.r) + half)), abs=1e-6
    )


def test_partial_r_is_near_zero_when_a_common_cause_makes_the_raw_r_large():
    # x and y each follow z, and nothing else ties them: raw r about 0.8, partial r about 0
    rng = np.random.default_rng(1)
    z = rng.normal(size=2000)
    x = z + 0.5 * rng.normal(size=2000)
    y = z + 0.5 * rng.normal(size=2000)
    assert pearson(x, y) > 0.75
    c = partial_interval(x, y, z)
    assert abs(c.r) < 0.05 and c.low < 0 < c.high
    # and the other way: a real x-y tie survives z
    y2 = 0.5 * x + z + 0.5 * rng.normal(size=2000)
    assert partial_r(x, y2, z) == pytest.approx(closed_form_partial(x, y2, z), abs=1e-12) and partial_r(x, y2, z) > 0.3


def test_partial_r_refuses_degenerate_data():
    x = np.arange(10.0)
    assert partial_r(x, x[::-1], np.ones(10)) is None  # z constant: nothing to hold fixed
    assert partial_r(x, np.sin(x), 2 * x + 1) is None  # x is a line in z: no residual left
    assert partial_r(x[:4], x[:4] ** 2, np.sin(x[:4])) is None  # too few points


def autocorrelated_runs(rng, n_runs: int, steps: int = 24, phi: float = 0.95) -> list[tuple[np.ndarray, ...]]:
    """Runs whose x and y are independent AR(1) series (true r = 0), each strongly autocorrelated within a run."""
    runs = []
    for _ in range(n_runs):
        series = []
        for _ in range(3):
            v = np.empty(steps)
            v[0] = rng.normal() / math.sqrt(1 - phi**2)
            for t in range(1, steps):
                v[t] = phi * v[t - 1] + rng.normal()
            series.append(v)
        runs.append(tuple(series))
    return runs


def test_the_run_bootstrap_is_wider_than_fisher_on_autocorrelated_runs():
    # Fisher counts all 240 steps as independent; the steps of a run are not, so the honest interval is wider
    rng = np.random.default_rng(2)
    for _ in range(5):
        runs = autocorrelated_runs(rng, n_runs=10)
        x, y = (np.concatenate([r[i] for r in runs]) for i in (0, 1))
        fisher = pearson_interval(x, y)
        low, high = run_bootstrap([runs], lambda x, y, z: pearson(x, y), resamples=500, seed=0)
        assert high - low > 1.5 * (fisher.high - fisher.low)
        assert low <= fisher.r <= high


def test_fisher_misses_a_true_zero_far_too_often_on_autocorrelated_runs_and_the_bootstrap_less_so():
    rng = np.random.default_rng(3)
    fisher_misses = boot_misses = 0
    trials = 40
    for _ in range(trials):
        runs = autocorrelated_runs(rng, n_runs=10)
        x, y = (np.concatenate([r[i] for r in runs]) for i in (0, 1))
        c = pearson_interval(x, y)
        fisher_misses += not c.low <= 0 <= c.high
        low, high = run_bootstrap([runs], lambda x, y, z: pearson(x, y), resamples=300, seed=0)
        boot_misses += not low <= 0 <= high
    assert fisher_misses / trials > 0.3  # a nominal 5%
    assert boot_misses < fisher_misses / 2


def test_the_run_bootstrap_keeps_each_strata_size_and_is_reproducible():
    rng = np.random.default_rng(4)
    a = [(rng.normal(size=5), np.zeros(5)) for _ in range(3)]  # second array 0: method a's points
    b = [(rng.normal(size=5), np.ones(5)) for _ in range(4)]  # 1: method b's points

    def share_of_b(x, label):
        return float(label.mean())

    # every resample holds 3 runs of a and 4 of b, whichever runs they are
    assert run_bootstrap([a, b], share_of_b, resamples=200) == pytest.approx((4 / 7, 4 / 7))
    stat = lambda x, label: float(x.mean())  # noqa: E731
    assert run_bootstrap([a, b], stat, seed=7) == run_bootstrap([a, b], stat, seed=7)
    assert run_bootstrap([a, b], stat, seed=7) != run_bootstrap([a, b], stat, seed=8)
    assert run_bootstrap([a[:1], b[:1]], stat) is None  # one run per stratum: every resample is the data


def test_the_run_bootstrap_is_the_percentile_interval_of_the_resampled_statistic():
    # one point per run and the mean as statistic: the resamples are those of the plain bootstrap of the mean
    values = [0.1, 0.4, 0.35, 0.8, 0.2]
    runs = [(np.array([v]),) for v in values]
    low, high = run_bootstrap([runs], lambda x: float(x.mean()), resamples=4000, seed=3)
    rng = np.random.default_rng(3)
    means = [np.mean([values[i] for i in rng.integers(0, 5, size=5)]) for _ in range(4000)]
    assert (low, high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])), abs=1e-12)


def test_holm_against_a_hand_computed_example():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> raised to 0.06 (monotone)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # at 0.05 the two smallest survive, the others do not
    assert [p <= 0.05 for p in holm([0.01, 0.04, 0.03, 0.005])] == [True, False, False, True]
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert holm([0.02]) == [0.02]  # a family of one is not corrected
    assert holm([]) == []


def test_sign_test_is_scipys_exact_binomial_test():
    for n in range(2, 13):
        for k in range(n + 1):
            d = [1.0] * k + [-1.0] * (n - k) + [0.0, 0.0]  # the zeros carry no sign and are dropped
            assert sign_test_p(d) == pytest.approx(binomtest(k, n, 0.5).pvalue, abs=1e-12), (k, n)
    assert sign_test_p([0.3, 0.0]) is None and sign_test_p([]) is None
    assert sign_test_p([0.1] * 7) == pytest.approx(2 / 2**7)  # all seven one way: 0.0156


def test_t_and_wilcoxon_p_values_are_scipys():
    d = [0.12, -0.03, 0.2, 0.08, 0.15, 0.01, 0.09]
    assert t_test_p(d) == pytest.approx(ttest_1samp(d, 0).pvalue, rel=1e-10)
    assert wilcoxon_p(d) == pytest.approx(wilcoxon(d).pvalue, rel=1e-10)
    assert wilcoxon_p([0.2, 0.3, 0.4]) == pytest.approx(0.25)  # exact: 2 of the 2^3 sign patterns as extreme
    assert t_test_p([0.3]) is None and wilcoxon_p([0.3, 0.0]) is None
    assert t_test_p([0.2, 0.2, 0.2]) == 0.0 and t_test_p([0.0, 0.0]) == 1.0  # no spread


def test_power_matches_the_textbook_and_a_simulation():
    # d = 1 with 10 pairs: 0.803 (Cohen's tables; G*Power gives 0.8031 for a two-sided one-sample t-test)
    assert paired_t_power(1.0, 1.0, 10) == pytest.approx(0.8031, abs=5e-4)
    assert paired_t_power(0.5, 1.0, 34) == pytest.approx(0.8078, abs=5e-4)
    assert paired_t_power(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-9)  # no effect: the test's level
    assert paired_t_power(-1.0, 1.0, 10) == pytest.approx(paired_t_power(1.0, 1.0, 10))  # two-sided
    # a simulation: normal differences with mean 0.6 and SD 1.5 (d = 0.4), 12 pairs, t-test at 0.05
    rng = np.random.default_rng(5)
    d = rng.normal(0.6, 1.5, size=(40_000, 12))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(12))
    simulated = float(np.mean(np.abs(t) > 2.200985))  # t(0.975, 11)
    assert paired_t_power(0.6, 1.5, 12) == pytest.approx(simulated, abs=0.01)
    assert paired_t_power(0.6, 1.5, 1) is None and paired_t_power(0.6, 0.0, 5) is None


def test_power_far_from_the_null_is_a_number_not_nan():
    # scipy's noncentral t gives NaN for the far tail here (nct.cdf(-2.09, 19, 9.46)); that tail is 0, the power
    # the near tail's, a hair below 1, for either sign of the effect
    for mean in (0.44, -0.44):
        power = paired_t_power(mean, 0.208, 20)
        assert not math.isnan(power) and power == pytest.approx(
            float(stats.nct.sf(stats.t.ppf(0.975, 19), 19, 0.44 / 0.208 * math.sqrt(20)))
        )
        assert 0.999 < power <= 1.0


def test_pairs_for_80_percent_power():
    assert pairs_for_power(1.0, 1.0) == 10  # the textbook's d = 1
    assert pairs_for_power(0.5, 1.0) == 34  # d = 0.5: 33 pairs give 0.797
    n = pairs_for_power(0.3, 1.1)
    assert paired_t_power(0.3, 1.1, n) >= 0.8 > paired_t_power(0.3, 1.1, n - 1)
    assert pairs_for_power(50.0, 1.0) == 2  # at least two pairs, whatever the effect
    assert pairs_for_power(5.0, 1.0) == 3  # two pairs leave one degree of freedom: t(0.975, 1) = 12.7
    assert pairs_for_power(0.0, 1.0) is None  # no effect: never


def test_paired_test_gathers_the_interval_the_p_values_and_the_power():
    d = [0.2, 0.35, 0.1, 0.3, 0.25]
    test = paired_test(d)
    assert test.estimate.mean == pytest.approx(0.24) and test.estimate.n == 5
    assert test.t_p == pytest.approx(ttest_1samp(d, 0).pvalue)
    assert test.sign_p == pytest.approx(2 / 2**5) and test.wilcoxon_p == pytest.approx(wilcoxon(d).pvalue)
    sd = float(np.std(d, ddof=1))
    assert test.power == pytest.approx(paired_t_power(0.24, sd, 5)) and test.pairs_for_80 == pairs_for_power(0.24, sd)
    one = paired_test([0.3])
    assert (one.t_p, one.sign_p, one.wilcoxon_p, one.power, one.pairs_for_80) == (None,) * 5
