"""The printed report's descriptive tables, in markdown: final values per method (one run or the mean over seeds),
seed by seed, pass@k, what the token-selecting objectives selected, the entropy-law fits and the band's noise
ceiling. The paired comparisons, Holm's correction and the mechanism check are in study/inference.py."""

from __future__ import annotations

import math

import numpy as np

from study.runs import (
    BAND,
    ENTROPY_KEY,
    EVAL_ACC_KEY,
    PASS_AT_K,
    TRAIN_ACC_KEY,
    Method,
    band_ceiling,
    final_value,
    method_curves,
    seed_values,
    share_in_band,
)
from study.stats import Estimate, mean_interval

# What a token-selecting objective logs per step (loss_terms.py): the share of tokens it selected, for Clip-Cov the
# share inside its bounds (its candidates), and whether its micro-batches selected nothing or only the floor.
SELECTED_KEYS = ("loss/clip_cov_frac", "loss/kl_cov_frac")
IN_BOUNDS_KEY = "loss/clip_cov_in_bounds"
STARVED_KEY = "loss/select_starved"


class Cuts:
    """The interval bounds a table printed cut to the quantity's range, gathered for the footnote under it: a bound
    cut at 0 (or 1) says less than the interval computed, so the table marks it and gives the uncut one."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def note(self, est: Estimate, spec: str, where: str) -> None:
        if est.low_cut or est.high_cut:
            self.found.append(f"{where} [{est.low_uncut:{spec}}, {est.high_uncut:{spec}}]")

    def footnote(self) -> str:
        """One line for under the table, or "" when nothing was cut."""
        if not self.found:
            return ""
        return "* cut to the range the quantity can take; the t-interval as computed: " + "; ".join(self.found)


def with_footnote(table: str, cuts: Cuts) -> str:
    return table + ("\n" + cuts.footnote() if cuts.found else "")


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def fmt_estimate(est: Estimate | None, spec: str, cuts: Cuts | None = None, where: str = "") -> str:
    """mean [low, high], a bound cut to the quantity's range marked with *; cuts gathers those for the footnote."""
    if est is None:
        return "n/a"
    if est.low is None:
        return format(est.mean, spec)
    if cuts is not None:
        cuts.note(est, spec, where)
    low = format(est.low, spec) + ("*" if est.low_cut else "")
    high = format(est.high, spec) + ("*" if est.high_cut else "")
    return f"{est.mean:{spec}} [{low}, {high}]"


def fit_table(methods: list[Method]) -> str:
    lines = [f"{'method':<16}{'accuracy key':<14}{'points':>7}{'a':>10}{'b':>10}{'b - a':>10}{'rmse':>10}"]
    for m in methods:
        if m.fit is None:
            lines.append(f"{m.label:<16}not fitted (see the notes below)")
            continue
        f = m.fit
        lines.append(
            f"{m.label:<16}{m.fit_key:<14}{f.n_points:>7}{f.a:>10.4g}{f.b:>10.4g}{f.ceiling:>10.4g}{f.rmse:>10.3g}"
        )
    return "\n".join(lines)


def ceiling_table(methods: list[Method], band: tuple[float, float], from_step: float) -> str:
    """Per method (mean over its runs): the noise of one step's entropy reading and the best share in the band that
    noise allows, beside the share measured, in markdown."""
    lines = [
        f"entropy reading noise and the band [{band[0]:g}, {band[1]:g}] (steps from {from_step:g} on; band_ceiling)",
        "| method | run count | noise sigma | best share possible | share measured |",
        "|---|---|---|---|---|",
    ]
    for m in methods:
        found = [
            (c, share_in_band(r, band, from_step=from_step)) for r in m.runs if (c := band_ceiling(r, band, from_step))
        ]
        if not found:
            continue
        sigma = float(np.mean([c[0] for c, _ in found]))
        best = float(np.mean([c[1] for c, _ in found]))
        measured = float(np.mean([v for _, v in found if v is not None]))
        lines.append(f"| {m.label} | {len(found)} | {sigma:.3f} | {best:.0%} | {measured:.0%} |")
    return "\n".join(lines)


def results_table(methods: list[Method], baseline: str, last: int = 10, band: tuple[float, float] | None = None) -> str:
    """study/notebook.md's table for one run per method, in markdown: final entropy, accuracies and the entropy ratio
    to the baseline run; with a band, also the share of the last steps whose entropy was inside it."""
    runs = {m.label: m.runs[0] for m in methods}
    base_h = final_value(runs[baseline], ENTROPY_KEY, last) if baseline in runs else None
    band_head = "" if band is None else f" in [{band[0]:g}, {band[1]:g}] (last {last}) |"
    lines = [
        f"| method | steps | entropy (last {last}) | entropy / {baseline} | train acc (last {last}) "
        f"| test acc (last eval) |{band_head}",
        "|---|---|---|---|---|---|" + ("" if band is None else "---|"),
    ]
    for label, run in runs.items():
        h = final_value(run, ENTROPY_KEY, last)
        steps = run.series(ENTROPY_KEY)
        ratio = h / base_h if h is not None and base_h else None
        lines.append(
            f"| {label} | {fmt(None if steps is None else len(steps[0]), 'd')} | {fmt(h, '.4f')} "
            f"| {fmt(ratio, '.2f')} | {fmt(final_value(run, TRAIN_ACC_KEY, last), '.3f')} "
            f"| {fmt(final_value(run, EVAL_ACC_KEY, 1), '.3f')} |"
            + ("" if band is None else f" {fmt(share_in_band(run, band, last), '.0%')} |")
        )
    return "\n".join(lines)


def _estimate(values: dict[str, dict[str, float]], metric: str) -> Estimate | None:
    bounds = (0.0, math.inf) if metric == ENTROPY_KEY else (0.0, 1.0)  # the others are accuracies and shares
    return mean_interval(list(values[metric].values()), bounds) if values.get(metric) else None


def seeds_table(
    methods: list[Method],
    baseline: str,
    last: int = 10,
    band: tuple[float, float] | None = None,
    band_from: float = 5,
) -> str:
    """The results table over seeds, in markdown: each figure as the mean over the method's seeds and its 95%
    t-interval; the entropy ratio is that of the means. A bound cut to the quantity's range is marked, the uncut
    interval in a footnote."""
    values = {m.label: seed_values(m, last, band, band_from) for m in methods}
    base = _estimate(values.get(baseline, {}), ENTROPY_KEY)
    band_title = f"in [{band[0]:g}, {band[1]:g}] (step >= {band_from:g})" if band is not None else ""
    lines = [
        f"| method | seeds | steps | entropy (last {last}) | entropy / {baseline} | train acc (last {last}) "
        f"| test acc (last eval) |" + ("" if band is None else f" {band_title} |"),
        "|---|---|---|---|---|---|---|" + ("" if band is None else "---|"),
    ]
    cuts = Cuts()
    for m in methods:
        v = values[m.label]
        lengths = sorted({len(c[0]) for c in method_curves(m, ENTROPY_KEY)})
        steps = "n/a" if not lengths else "-".join(str(n) for n in dict.fromkeys([lengths[0], lengths[-1]]))
        h, train, test = (_estimate(v, key) for key in (ENTROPY_KEY, TRAIN_ACC_KEY, EVAL_ACC_KEY))
        ratio = h.mean / base.mean if h is not None and base is not None and base.mean else None
        cells = [
            fmt_estimate(h, ".3f", cuts, f"{m.label} entropy"),
            fmt(ratio, ".2f"),
            fmt_estimate(train, ".3f", cuts, f"{m.label} train acc"),
            fmt_estimate(test, ".3f", cuts, f"{m.label} test acc"),
        ]
        if band is not None:
            cells.append(fmt_estimate(_estimate(v, BAND), ".0%", cuts, f"{m.label} {band_title}"))
        lines.append(f"| {m.label} | {len(m.runs)} | {steps} | " + " | ".join(cells) + " |")
    return with_footnote("\n".join(lines), cuts)


def per_seed_table(
    methods: list[Method],
    baseline: str,
    last: int = 10,
    band: tuple[float, float] | None = None,
    band_from: float = 5,
) -> str:
    """Each run on its own row, seed by seed, in markdown: its entropy over the last steps, that entropy over the
    baseline's of the same seed, pass@1 and pass@<largest k> at its last evaluation, and with a band the share of
    steps inside it. What a mean hides: whether a method beat the baseline in every seed."""
    values = {m.label: seed_values(m, last, band, band_from) for m in methods}
    base_h = values.get(baseline, {}).get(ENTROPY_KEY, {})
    ks = sorted({int(PASS_AT_K.fullmatch(k).group(1)) for v in values.values() for k in v if PASS_AT_K.fullmatch(k)})
    top = [1, ks[-1]] if ks and ks[-1] != 1 else ks
    band_head = "" if band is None else f" in [{band[0]:g}, {band[1]:g}] (step >= {band_from:g}) |"
    lines = [
        f"| seed | method | entropy (last {last}) | entropy / {baseline} (same seed) | "
        + "".join(f"pass@{k} | " for k in top)
        + band_head.lstrip(),
        "|---|---|---|---|" + "---|" * len(top) + ("" if band is None else "---|"),
    ]
    seeds = sorted({run.seed for m in methods for run in m.runs}, key=lambda s: (len(s), s))
    for seed in seeds:
        for m in methods:
            v = values[m.label]
            if not any(run.seed == seed for run in m.runs):
                continue
            h, b = v.get(ENTROPY_KEY, {}).get(seed), base_h.get(seed)
            ratio = h / b if h is not None and b else None
            cells = [fmt(h, ".3f"), fmt(ratio, ".2f")]
            cells += [fmt(v.get(f"eval/pass@{k}", {}).get(seed), ".3f") for k in top]
            if band is not None:
                cells.append(fmt(v.get(BAND, {}).get(seed), ".0%"))
            lines.append(f"| {seed.removeprefix('seed') or '?'} | {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def selection_table(methods: list[Method]) -> str:
    """How much a Clip-Cov or KL-Cov run selected, each run on its own row, in markdown: the share of tokens selected
    (mean over the logged steps), for Clip-Cov the share inside the bounds and the selected share of those (ratio of
    the two means), and the share of micro-batches that selected nothing or only the one-token floor
    (`loss/select_starved`, itself a share per step). Empty when no run selects tokens."""
    lines = [
        "| seed | method | tokens selected | inside the bounds | selected / inside | micro-batches starved |",
        "|---|---|---|---|---|---|",
    ]
    for m in methods:
        for run in m.runs:
            names = run.metric_names()
            key = next((k for k in SELECTED_KEYS if k in names), None)
            if key is None:
                continue
            selected = float(np.mean(run.series(key)[1]))
            inside = float(np.mean(run.series(IN_BOUNDS_KEY)[1])) if IN_BOUNDS_KEY in names else None
            share = selected / inside if inside else None
            starved = float(np.mean(run.series(STARVED_KEY)[1])) if STARVED_KEY in names else None
            cells = [fmt(selected, ".2%"), fmt(inside, ".2%"), fmt(share, ".0%"), fmt(starved, ".0%")]
            lines.append(f"| {run.seed.removeprefix('seed') or '?'} | {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def pass_at_k_table(curves: dict[str, list[tuple[int, Estimate]]]) -> str:
    """pass@k at the last evaluation, one row per method, one column per k any run logged; a bound cut at 0 or 1 is
    marked, the uncut interval in a footnote."""
    ks = sorted({k for c in curves.values() for k, _ in c})
    lines = ["| method | runs | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---|---|" + "---|" * len(ks)]
    cuts = Cuts()
    for label, curve in curves.items():
        by_k = dict(curve)
        cells = " | ".join(fmt_estimate(by_k.get(k), ".3f", cuts, f"{label} pass@{k}") for k in ks)
        lines.append(f"| {label} | {max(e.n for _, e in curve)} | {cells} |")
    return with_footnote("\n".join(lines), cuts)
