"""The study's statistics, on plain numbers (no runs here): means over seeds with t-intervals, paired tests and their
power, Holm's correction, and correlations with Fisher and run-level bootstrap intervals.

Seeds are few (3 to 7), so every interval is a t-interval over them and every paired test is exact or small-sample:
the t-test, the exact sign test and the Wilcoxon signed-rank test side by side, none of them assuming more than the
pairs give."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from scipy import stats as sps

Z975 = float(sps.norm.ppf(0.975))
MAX_PAIRS = 10_000  # pairs_for_power looks no further


class Estimate(NamedTuple):
    """A mean over n values and its 95% t-interval (None with fewer than two values), cut to the range the quantity
    can take; low_uncut and high_uncut keep the interval as computed, so a cut bound can be shown as one."""

    mean: float
    low: float | None
    high: float | None
    n: int
    low_uncut: float | None = None
    high_uncut: float | None = None

    @property
    def low_cut(self) -> bool:
        return self.low is not None and self.low != self.low_uncut

    @property
    def high_cut(self) -> bool:
        return self.high is not None and self.high != self.high_uncut


class Correlation(NamedTuple):
    r: float
    low: float
    high: float
    n: int


class PairedTest(NamedTuple):
    """A method minus the baseline over seed pairs: the mean difference with its t-interval, three two-sided p-values
    (None with one pair, or when no pair differs) and the t-test's power at the observed effect."""

    estimate: Estimate
    t_p: float | None
    sign_p: float | None
    wilcoxon_p: float | None
    power: float | None
    pairs_for_80: int | None


def t95(df: float) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom."""
    return float(sps.t.ppf(0.975, df))


def mean_interval(values: Sequence[float], bounds: tuple[float, float] = (-math.inf, math.inf)) -> Estimate:
    """Mean and 95% t-interval over the values, one per seed: mean +- t(n-1) s / sqrt(n), cut to `bounds`, the
    range the quantity can take (with three seeds t is 4.3 and a share's interval would otherwise pass 100%). The
    interval before the cut is kept beside it."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values to average")
    mean = float(x.mean())
    if x.size < 2:
        return Estimate(mean, None, None, 1)
    half = t95(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    low, high = mean - half, mean + half
    return Estimate(mean, max(low, bounds[0]), min(high, bounds[1]), int(x.size), low, high)


def paired_differences(values: dict[str, float], base: dict[str, float]) -> np.ndarray:
    """values[s] - base[s] over the seeds both ran ({seed: value} each), in the order of `values`."""
    return np.array([values[s] - base[s] for s in values if s in base], dtype=float)


def paired_difference(
    values: dict[str, float], base: dict[str, float], bounds: tuple[float, float] = (-math.inf, math.inf)
) -> Estimate | None:
    """Method minus baseline over the seeds both ran ({seed: value} each): the mean of the per-seed differences, which
    is the difference of the two means over those seeds, and its t-interval. None when they share no seed."""
    d = paired_differences(values, base)
    return mean_interval(d, bounds) if d.size else None


def t_test_p(differences: Sequence[float]) -> float | None:
    """Two-sided p of the one-sample t-test of mean 0 over the paired differences; None with fewer than two. With no
    spread at all the test is degenerate: p = 0 when the differences are all one non-zero value, 1 when all 0."""
    d = np.asarray(differences, dtype=float)
    if d.size < 2:
        return None
    if np.ptp(d) == 0:  # its SD would be 0, or rounding noise that turns t into an arbitrary huge number
        return 0.0 if d[0] != 0 else 1.0
    t = float(d.mean()) / (float(d.std(ddof=1)) / math.sqrt(d.size))
    return float(2 * sps.t.sf(abs(t), d.size - 1))


def sign_test_p(differences: Sequence[float]) -> float | None:
    """Exact two-sided sign test: under no effect each non-zero difference is positive with probability 1/2, so the
    count of positives is Binomial(n, 1/2); p is twice the smaller tail, at most 1. Zero differences carry no sign
    and are dropped. None when fewer than two differences are non-zero."""
    d = np.asarray(differences, dtype=float)
    d = d[d != 0]
    n = int(d.size)
    if n < 2:
        return None
    k = int((d > 0).sum())
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


def wilcoxon_p(differences: Sequence[float]) -> float | None:
    """Two-sided p of the Wilcoxon signed-rank test (scipy's: exact for small n without ties, zeros dropped); None
    when fewer than two differences are non-zero."""
    d = np.asarray(differences, dtype=float)
    if int((d != 0).sum()) < 2:
        return None
    return float(sps.wilcoxon(d).pvalue)


def paired_t_power(mean_diff: float, sd_diff: float, n: int, alpha: float = 0.05) -> float | None:
    """Power of the two-sided paired t-test at level alpha with n pairs when the differences have this mean and SD:
    the chance that |T| exceeds the critical t(1 - alpha/2, n - 1), T being noncentral t with n - 1 degrees of
    freedom and noncentrality mean / sd * sqrt(n). None with fewer than two pairs or no spread."""
    if n < 2 or not sd_diff > 0:
        return None
    # the power is the same for -nc; with nc >= 0 the far tail's scipy value can come back NaN where it underflows
    # (nct.cdf(-2.09, 19, 9.46)), and then it is 0 to double precision
    df, nc = n - 1, abs(mean_diff) / sd_diff * math.sqrt(n)
    crit = float(sps.t.ppf(1 - alpha / 2, df))
    far = float(sps.nct.cdf(-crit, df, nc))
    return float(sps.nct.sf(crit, df, nc)) + (0.0 if math.isnan(far) else far)


def pairs_for_power(
    mean_diff: float, sd_diff: float, power: float = 0.8, alpha: float = 0.05, max_pairs: int = MAX_PAIRS
) -> int | None:
    """The fewest pairs (at least 2) at which the paired t-test reaches `power` for this effect; None when even
    max_pairs do not (a zero effect never does) or there is no spread."""
    if not sd_diff > 0 or paired_t_power(mean_diff, sd_diff, max_pairs, alpha) < power:
        return None
    low, high = 1, 2  # power(low) < target <= power(high), found by doubling then halving: it grows with n
    while paired_t_power(mean_diff, sd_diff, high, alpha) < power:
        low, high = high, min(2 * high, max_pairs)
    while high - low > 1:
        mid = (low + high) // 2
        if paired_t_power(mean_diff, sd_diff, mid, alpha) < power:
            low = mid
        else:
            high = mid
    return high


def paired_test(differences: Sequence[float], bounds: tuple[float, float] = (-math.inf, math.inf)) -> PairedTest:
    """Everything the report prints about one paired comparison, from the per-seed differences."""
    d = np.asarray(differences, dtype=float)
    estimate = mean_interval(d, bounds)
    sd = float(d.std(ddof=1)) if d.size > 1 and np.ptp(d) > 0 else 0.0  # rounding noise is no spread
    return PairedTest(
        estimate,
        t_test_p(d),
        sign_test_p(d),
        wilcoxon_p(d),
        paired_t_power(float(d.mean()), sd, int(d.size)),
        pairs_for_power(float(d.mean()), sd) if d.size > 1 else None,
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p (from i = 1) is multiplied by
    m - i + 1, each kept at least as large as the one before it in that order and at most 1. A test survives at
    level alpha when its adjusted p is at or below alpha; the family-wise error stays at most alpha."""
    m = len(p_values)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _fisher(r: float, n: int, controlled: int = 0) -> tuple[float, float]:
    """95% interval of a (partial) correlation by Fisher's z: tanh(atanh(r) -+ z(0.975) / sqrt(n - 3 - controlled))."""
    # atanh(+-1) is infinite: a perfect correlation keeps its interval at the bound rather than turning into NaN
    z = math.atanh(min(max(r, -1 + 1e-12), 1 - 1e-12))
    half = Z975 / math.sqrt(n - 3 - controlled)
    return math.tanh(z - half), math.tanh(z + half)


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson r; None with fewer than 4 points or when either variable is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 4 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def pearson_interval(x: np.ndarray, y: np.ndarray) -> Correlation | None:
    """Pearson r and its 95% interval by Fisher's z. None with fewer than 4 points or when either variable is
    constant."""
    r = pearson(x, y)
    if r is None:
        return None
    return Correlation(r, *_fisher(r, len(x)), len(x))


def _residuals(v: np.ndarray, z: np.ndarray) -> np.ndarray:
    """What is left of v after its least-squares line on z (with an intercept)."""
    design = np.column_stack([np.ones_like(z), z])
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    return v - design @ coef


def partial_r(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> float | None:
    """The partial correlation of x and y given z: Pearson r of their residuals after each is regressed on z. None
    with fewer than 5 points or when z or a residual is constant."""
    x, y, z = (np.asarray(v, dtype=float) for v in (x, y, z))
    if x.size < 5 or np.ptp(z) == 0:
        return None
    rx, ry = _residuals(x, z), _residuals(y, z)
    # a residual left at rounding noise means x (or y) is a line in z: nothing is left to correlate
    scale = max(float(np.abs(x).max()), float(np.abs(y).max()), 1e-300)
    if np.ptp(rx) <= 1e-12 * scale or np.ptp(ry) <= 1e-12 * scale:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def partial_interval(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> Correlation | None:
    """The partial correlation of x and y given z with its 95% Fisher interval (one controlled variable: n - 4)."""
    r = partial_r(x, y, z)
    if r is None:
        return None
    return Correlation(r, *_fisher(r, len(x), controlled=1), len(x))


def run_bootstrap(
    strata: Sequence[Sequence[tuple[np.ndarray, ...]]],
    statistic: Callable[..., float | None],
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile interval of `statistic` over whole runs resampled with replacement.

    Each run is a tuple of equally long arrays (one entry per step); the steps of a run are autocorrelated, so the
    run, not the step, is the independent unit. Each stratum (one per method) is resampled on its own, keeping its
    number of runs, so a resample has the design's mix of methods; the resampled runs' arrays are concatenated and
    `statistic(*arrays)` computed. Resamples where it is None (a constant variable) are skipped. The same seed
    draws the same runs for every statistic. None when no stratum has two runs (every resample is the data) or
    no resample gives a value."""
    if not any(len(runs) > 1 for runs in strata):
        return None
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        picked = [runs[i] for runs in strata for i in rng.integers(0, len(runs), size=len(runs))]
        value = statistic(*(np.concatenate(columns) for columns in zip(*picked)))
        if value is not None:
            values.append(value)
    if not values:
        return None
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)
