"""The report's inferential tables, in markdown: each method against the baseline paired by seed (t-interval, t,
sign and Wilcoxon p-values, power), Holm's correction over a family of those tests, and the mechanism check
(covariance against the next entropy change: Pearson and partial r, Fisher and run-level bootstrap intervals)."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from study.runs import (
    BAND,
    COV_KEY,
    ENTROPY_KEY,
    EVAL_ACC_KEY,
    PASS_AT_K,
    TRAIN_ACC_KEY,
    MechanismPoints,
    Method,
    pooled,
    seed_values,
)
from study.stats import (
    MAX_PAIRS,
    PairedTest,
    holm,
    paired_test,
    partial_interval,
    partial_r,
    pearson,
    pearson_interval,
    run_bootstrap,
)
from study.tables import Cuts, fmt, with_footnote

LOG_RATIO = "log_entropy_ratio"  # ln(method's entropy / the baseline's), per seed: the effect is multiplicative
ALPHA = 0.05
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# Fewer runs than this get no bootstrap interval: three runs give 10 distinct resamples, and resampling n runs
# understates the spread by a factor of about sqrt((n - 1) / n), so such an interval comes out too narrow.
MIN_BOOTSTRAP_RUNS = 5


@dataclass
class Comparison:
    """One paired test the report prints: a method minus the baseline on one metric, over the seeds both ran."""

    method: str
    metric: str  # the name --family matches: entropy, log_entropy_ratio, train_acc, test_acc, band or pass@<k>
    title: str  # the metric as the table shows it
    spec: str  # the number format of its difference
    test: PairedTest

    @property
    def name(self) -> str:
        return f"{self.method}:{self.metric}"


def metric_names(
    last: int, band: tuple[float, float] | None, band_from: float, baseline: str
) -> dict[str, tuple[str, str]]:
    """{seed_values key: (the --family name, the title)} in the order the table lists them."""
    names = {
        ENTROPY_KEY: ("entropy", f"entropy (last {last})"),
        LOG_RATIO: (LOG_RATIO, f"ln(entropy / {baseline}) (last {last})"),
        TRAIN_ACC_KEY: ("train_acc", f"train acc (last {last})"),
        EVAL_ACC_KEY: ("test_acc", "test acc (last eval)"),
    }
    if band is not None:
        names[BAND] = ("band", f"in [{band[0]:g}, {band[1]:g}] (step >= {band_from:g})")
    return names


def logs(values: dict[str, float]) -> dict[str, float]:
    """{seed: ln(value)} over the positive values: differences of these, paired by seed, are the log ratios."""
    return {s: math.log(v) for s, v in values.items() if v > 0}


def compare(
    methods: list[Method],
    baseline: str,
    last: int = 10,
    band: tuple[float, float] | None = None,
    band_from: float = 5,
) -> list[Comparison]:
    """Every method minus the baseline, paired by seed, on every metric both logged: one Comparison each, in the
    table's order. A method sharing no seed with the baseline gets a note instead."""
    values = {m.label: seed_values(m, last, band, band_from) for m in methods}
    if baseline not in values:
        return []
    base = dict(values[baseline])
    if ENTROPY_KEY in base:
        base[LOG_RATIO] = logs(base[ENTROPY_KEY])
    names = metric_names(last, band, band_from, baseline)
    ks = sorted({int(PASS_AT_K.fullmatch(k).group(1)) for v in values.values() for k in v if PASS_AT_K.fullmatch(k)})
    names.update({f"eval/pass@{k}": (f"pass@{k}", f"pass@{k}") for k in ks})
    base_seeds = {run.seed for m in methods if m.label == baseline for run in m.runs}
    found = []
    for m in methods:
        if m.label == baseline:
            continue
        if not base_seeds & {run.seed for run in m.runs}:
            m.notes.append(
                f"no seed in common with {baseline}, not compared (seeds pair by the seed<N> in their paths)"
            )
            continue
        mine = dict(values[m.label])
        if ENTROPY_KEY in mine:
            mine[LOG_RATIO] = logs(mine[ENTROPY_KEY])
        for metric, (name, title) in names.items():
            if metric not in mine or metric not in base:
                continue
            d = np.array([mine[metric][s] - base[metric][s] for s in mine[metric] if s in base[metric]])
            if d.size == 0:  # both logged it, but in different seeds
                continue
            # a difference of accuracies or shares lies in [-1, 1]; entropies and log ratios are unbounded
            bounds = (-math.inf, math.inf) if metric in (ENTROPY_KEY, LOG_RATIO) else (-1.0, 1.0)
            spec = "+.0%" if metric == BAND else "+.3f"
            found.append(Comparison(m.label, name, title, spec, paired_test(d, bounds)))
    return found


def fmt_p(p: float | None) -> str:
    """Three significant digits (0.916, 0.0504, 0.00119, 1.00): a small p keeps its digits, as Holm multiplies it."""
    return "n/a" if p is None else f"{p:#.3g}"


def paired_table(methods: list[Method], baseline: str, comparisons: list[Comparison]) -> str:
    """Each method minus the baseline, paired by seed, in markdown: the mean difference, its 95% t-interval over the
    seed pairs and whether it excludes 0; then the two-sided p of the t-test, the exact sign test and the Wilcoxon
    signed-rank test, the t-test's power at the observed mean and SD of the differences, and the pairs it would
    need for 80% power at that effect. A bound cut to [-1, 1] is marked, the uncut interval in a footnote."""
    if baseline not in {m.label for m in methods}:
        return f"no method is labelled {baseline!r}: no paired comparison (--baseline)"
    if len(methods) == 1:
        return ""  # the baseline alone: nothing to compare
    if not comparisons:
        return f"no paired comparison: no method shares a seed with {baseline}"
    lines = [
        f"| method - {baseline} | metric | difference | 95% interval | seed pairs | | t-test p | sign test p "
        "| Wilcoxon p | power at this effect | pairs for 80% power |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cuts = Cuts()
    for c in comparisons:
        d, spec = c.test.estimate, c.spec
        if d.low is None:
            interval, verdict = "n/a", "one seed pair: no interval"
        else:
            cuts.note(d, spec, f"{c.method} {c.title}")
            low = format(d.low, spec) + ("*" if d.low_cut else "")
            high = format(d.high, spec) + ("*" if d.high_cut else "")
            interval = f"[{low}, {high}]"
            significant = d.low_uncut > 0 or d.high_uncut < 0
            verdict = "excludes 0" if significant else f"not significant at {d.n} seeds"
        pairs = c.test.pairs_for_80
        needed = "n/a" if c.test.power is None else f"> {MAX_PAIRS}" if pairs is None else pairs
        lines.append(
            f"| {c.method} | {c.title} | {d.mean:{spec}} | {interval} | {d.n} | {verdict} | {fmt_p(c.test.t_p)} "
            f"| {fmt_p(c.test.sign_p)} | {fmt_p(c.test.wilcoxon_p)} | {fmt(c.test.power, '.2f')} | {needed} |"
        )
    return with_footnote("\n".join(lines), cuts)


def family(comparisons: list[Comparison], patterns: str) -> list[Comparison]:
    """The comparisons a --family names: comma-separated METHOD:METRIC patterns (shell wildcards, e.g. kl_cov:pass@*
    or *:train_acc), each of which must name at least one test with a p-value. ValueError otherwise, listing the
    names: a misspelt endpoint must not shrink a pre-registered family unnoticed."""
    tested = [c for c in comparisons if c.test.t_p is not None]
    chosen: list[Comparison] = []
    for pattern in (p.strip() for p in patterns.split(",")):
        matched = [c for c in tested if fnmatch.fnmatchcase(c.name, pattern)]
        if ":" not in pattern or not matched:
            names = ", ".join(c.name for c in tested) or "none (no paired test with two or more pairs)"
            raise ValueError(f"--family {patterns}: {pattern!r} names no paired test; the tests are: {names}")
        chosen += [c for c in matched if c not in chosen]
    return chosen


def holm_table(members: list[Comparison], baseline: str, what: str) -> str:
    """Holm's correction over a family of paired t-tests, in markdown: each test's raw and adjusted p, and whether
    it survives at 0.05 (the family-wise error rate)."""
    adjusted = holm([c.test.t_p for c in members])
    lines = [
        f"Holm's correction over {what} ({len(members)} t-tests; survives: Holm p <= {ALPHA:g})",
        f"| method - {baseline} | metric | t-test p | Holm p | at {ALPHA:g} |",
        "|---|---|---|---|---|",
    ]
    for c, p in zip(members, adjusted):
        verdict = "survives" if p <= ALPHA else "does not survive"
        lines.append(f"| {c.method} | {c.title} | {fmt_p(c.test.t_p)} | {fmt_p(p)} | {verdict} |")
    return "\n".join(lines)


def holm_tables(comparisons: list[Comparison], baseline: str, families: list[str]) -> list[str]:
    """The family of every paired t-test printed (none when no test has a p-value), then each --family on its own;
    ValueError when a --family names no test."""
    tested = [c for c in comparisons if c.test.t_p is not None]
    tables = [holm_table(tested, baseline, "every paired t-test above")] if tested else []
    return tables + [holm_table(family(comparisons, spec), baseline, f"--family {spec}") for spec in families]


def _interval(bounds: tuple[float, float] | None) -> str:
    return "n/a" if bounds is None else f"[{bounds[0]:+.3f}, {bounds[1]:+.3f}]"


def _bootstrap(
    strata: list[list[MechanismPoints]], statistic: Callable[..., float | None]
) -> tuple[float, float] | None:
    """The run-level bootstrap interval of a correlation over these runs; None under MIN_BOOTSTRAP_RUNS runs."""
    if sum(len(runs) for runs in strata) < MIN_BOOTSTRAP_RUNS:
        return None
    return run_bootstrap(strata, statistic, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)


def mechanism_table(points: dict[str, list[MechanismPoints]]) -> str:
    """Pearson r of cov/mean[t] against entropy[t+1] - entropy[t], over all runs and per method, with its Fisher
    interval; beside it the partial r with entropy[t] held fixed (a low entropy has less room to fall, and the
    covariance may follow the entropy level), and for both a run-level bootstrap interval: a run's ~24 step pairs
    are autocorrelated, so Fisher's interval, which counts every step as independent, is too narrow. Empty when no
    run logged the covariance."""
    if not points:
        return ""
    # "all" resamples the runs of every method together, one pool: resampled within each method instead, an arm of
    # three runs would give a spread too small by about sqrt(2/3) (n runs resampled vary as (n - 1) / n of them);
    # the pool adds the spread between methods' links, so its interval errs wide rather than narrow
    groups = {"all": [[run for runs in points.values() for run in runs]]} if len(points) > 1 else {}
    groups.update({label: [runs] for label, runs in points.items()})
    lines = [
        f"mechanism: {COV_KEY} at step t against {ENTROPY_KEY}[t+1] - [t] (the paper: the change follows minus the "
        "covariance, r < 0)",
        "| runs | points | Pearson r | 95% interval (Fisher z) | run bootstrap 95% | partial r (given entropy[t]) "
        "| 95% interval (Fisher z) | run bootstrap 95% | run count |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, strata in groups.items():
        x, y, z = pooled([run for runs in strata for run in runs])
        n_runs = sum(len(runs) for runs in strata)
        plain, partial = pearson_interval(x, y), partial_interval(x, y, z)
        if plain is None:
            why = "n/a (fewer than 4 points, or a constant)"
            lines.append(f"| {label} | {len(x)} | n/a | {why} | n/a | n/a | n/a | n/a | {n_runs} |")
            continue
        cells = [f"{plain.r:+.3f}", _interval((plain.low, plain.high))]
        cells.append(_interval(_bootstrap(strata, lambda x, y, _: pearson(x, y))))
        if partial is None:
            cells += ["n/a", "n/a", "n/a"]
        else:
            cells += [f"{partial.r:+.3f}", _interval((partial.low, partial.high))]
            cells.append(_interval(_bootstrap(strata, partial_r)))
        lines.append(f"| {label} | {plain.n} | " + " | ".join(cells) + f" | {n_runs} |")
    lines.append(
        f"run bootstrap: whole runs resampled with replacement (for 'all', from every method's runs pooled), "
        f"{BOOTSTRAP_RESAMPLES} times (seed {BOOTSTRAP_SEED}), percentile interval; n/a under {MIN_BOOTSTRAP_RUNS} "
        "runs. "
        "Partial r: cov and the change each regressed on entropy[t], the residuals correlated (Fisher with n - 4)."
    )
    return "\n".join(lines)
