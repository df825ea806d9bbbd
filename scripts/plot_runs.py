"""Plot and tabulate several runs side by side, one line per method, with one or several seeds per method: entropy
and accuracy against step, pass@k against k, the entropy law R = -a exp(H) + b fitted per method, and the paper's
mechanism (each step's entropy change against its covariance).

    python scripts/plot_runs.py grpo=outputs/grpo kl_cov=outputs/kl_cov clip_cov=runs/clip_cov.csv --out docs/
    python scripts/plot_runs.py grpo=docs/runs/grpo_seed1 grpo=docs/runs/grpo_seed2 grpo=docs/runs/grpo_seed3 \
        kl_cov=docs/runs/kl_cov_seed1 kl_cov=docs/runs/kl_cov_seed2 kl_cov=docs/runs/kl_cov_seed3 \
        --out docs --prefix study_ --band 0.5,0.8

Each run is LABEL=PATH (or just PATH: the label is then the folder or file name). PATH is a W&B offline run folder
written by our trainer (it holds files/metrics.jsonl), a folder holding metrics.jsonl (docs/runs/<run>), a folder
with exactly one such run below it (a pipeline's --train.output_dir), or a CSV with a `step` column and one column
per metric. A label given several times names one method's seeds (different runs). Seeds are paired with the
baseline's by the `seed<N>` in their paths (grpo_seed2 with kl_cov_seed2: same data and first rollouts), else by
their order on the command line.

Writes into --out:
    <prefix>entropy.png       `entropy/seq_mean` against step; with seeds, their mean and (shaded) min-max
    <prefix>accuracy.png      `reward/acc` (faint) and, where logged, `eval/acc` (dashed) against step, likewise
    <prefix>pass_at_k.png     `eval/pass@k` at each run's last evaluation against k (log2 axis), with seeds their
                              mean and 95% t-interval; only when some run logged pass@k
    <prefix>cov_entropy.png   the mechanism check: `cov/mean` at step t against entropy[t+1] - entropy[t], every
                              step of every run, with the Pearson r and its 95% interval (Fisher z) in the title;
                              only when the runs logged `cov/mean`
    <prefix>entropy_law.png   accuracy against entropy with each method's fitted law (seeds pooled)
    <prefix>fit_<label>.png   one method's fit (entropy_law.plot_fit)

and prints, in markdown:
- one run per method: each method's final entropy (mean of the last --last steps), entropy ratio to --baseline,
  train accuracy (last --last steps) and held-out accuracy (last evaluation): the table of docs/results.md.
  `--band LO,HI` (an entropy controller's `--entropy.target`) shades the band on the entropy plot and adds a column:
  the share of each run's last --last steps whose entropy was inside it.
- several seeds for some method: the same figures, each run's value as above, as a mean over the method's seeds
  with a 95% t-interval over them (n seeds, n - 1 degrees of freedom, scipy's t or a table; no interval with one
  seed; cut to the range the quantity can take, [0, 1] for accuracies and shares), the band column as the share of
  steps from --band-from (5) on inside the band; then each method minus --baseline, paired by seed: the mean of the
  per-seed differences with its t-interval, "excludes 0" or "not significant at n seeds"; then every run on its own
  row, seed by seed: its entropy, that over the baseline's of the same seed, pass@1 and pass@<largest k>, the band
  share (whether a method beat the baseline in every seed, which a mean hides); then, for Clip-Cov and KL-Cov runs,
  how much each selected: its share of tokens, for Clip-Cov of those inside the bounds, and of micro-batches starved.
- pass@k at each run's last evaluation (mean and interval over seeds), when logged: every k a run logged
  (`eval/pass@<k>`, the average over sources). A run without pass@k is left out of it with a note; a run whose last
  pass@k comes before its last step (its final weights were not evaluated) gets a note;
- each method's fit (a, b, the ceiling b - a, RMSE). The fit uses `--fit-acc`; `auto` is `eval/acc` when the
  method's runs hold at least two evaluations between them, else `reward/acc`;
- the mechanism check: Pearson r of cov/mean[t] against the next step's entropy change, over all runs and per method.
  The paper's claim is that the entropy change follows minus the covariance: r < 0.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from entropy_openrlhf.algorithms.entropy_law import (
    EntropyLawFit,
    fit_entropy_law,
    plot_fit,
    read_csv,
    read_wandb_offline,
)

try:  # scipy's exact t quantile when it is there; the table below otherwise
    from scipy.stats import t as student_t
except ImportError:  # pragma: no cover - scipy ships with the project's stack
    student_t = None

ENTROPY_KEY = "entropy/seq_mean"
TRAIN_ACC_KEY = "reward/acc"
EVAL_ACC_KEY = "eval/acc"
COV_KEY = "cov/mean"
KNOB_KEYS = ("entropy_ctl/scale", "entropy_ctl/bonus")  # what the entropy controller set, step by step
PASS_AT_K = re.compile(r"eval/pass@(\d+)")  # the average over sources; not eval/<source>/pass@k or the _ci95 bounds
BAND = "band"  # the seed values' name for the share of steps inside --band

# Two-sided 95% quantiles of Student's t (0.975) by degrees of freedom, for when scipy is missing. A df between two
# rows takes the smaller df's value: the interval is then slightly wider, never narrower.
T95_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
T95_TABLE.update({12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980, math.inf: 1.960})


@dataclass
class Run:
    """One training run (one seed): a CSV file or a run folder holding files/metrics.jsonl."""

    source: Path
    seed: str = ""  # pairs it with the baseline's run of the same seed; set when the methods are grouped

    def pairs(self, x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) over the logged steps that hold both keys, in step order; ValueError when none do."""
        if self.source.is_dir():
            return read_wandb_offline(self.source, x_key, y_key)
        return read_csv(self.source, x_key, y_key)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(steps, values) of one metric, or None when the run never logged it."""
        try:
            return self.pairs("step", key)
        except ValueError:
            return None

    def metric_names(self) -> set[str]:
        """Every metric name the run logged at some step (the readers above need the names up front)."""
        if not self.source.is_dir():
            with open(self.source, newline="") as f:
                return set(csv.DictReader(f).fieldnames or ())
        path = self.source / "files" / "metrics.jsonl"
        names: set[str] = set()
        for line in (path if path.exists() else self.source / "metrics.jsonl").read_text().splitlines():
            if line.strip():
                names.update(json.loads(line))
        return names

    def pass_at_k(self) -> dict[int, tuple[float, float]]:
        """{k: (step, eval/pass@k)} at the last step that logged each k; empty when the run logged no pass@k."""
        found = {}
        for name in self.metric_names():
            match = PASS_AT_K.fullmatch(name)
            if match and (s := self.series(name)) is not None:
                found[int(match.group(1))] = (float(s[0][-1]), float(s[1][-1]))
        return dict(sorted(found.items()))


@dataclass
class Method:
    """One label on the command line: its runs, one per seed, and the entropy law fitted on all of them."""

    label: str
    runs: list[Run]
    fit: EntropyLawFit | None = None
    fit_key: str = ""
    fit_points: tuple[np.ndarray, np.ndarray] | None = None
    notes: list[str] = field(default_factory=list)

    def pairs(self, x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of every run in turn, each in step order; ValueError when no run holds both keys."""
        found, last = [], None
        for run in self.runs:
            try:
                found.append(run.pairs(x_key, y_key))
            except ValueError as e:
                last = e
        if not found:
            raise last
        return np.concatenate([x for x, _ in found]), np.concatenate([y for _, y in found])


class Estimate(NamedTuple):
    """A mean over n seeds and its 95% interval (None with fewer than two seeds)."""

    mean: float
    low: float | None
    high: float | None
    n: int


class Correlation(NamedTuple):
    r: float
    low: float
    high: float
    n: int


def t95(df: float) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom (scipy's, else the table's, conservative)."""
    if student_t is not None:
        return float(student_t.ppf(0.975, df))
    return T95_TABLE[max(d for d in T95_TABLE if d <= df)]


def mean_interval(values: list[float], bounds: tuple[float, float] = (-math.inf, math.inf)) -> Estimate:
    """Mean and 95% t-interval over the values, one per seed: mean +- t(n-1) s / sqrt(n), cut to `bounds`, the
    range the quantity can take (with three seeds t is 4.3 and a share's interval would otherwise pass 100%)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values to average")
    mean = float(x.mean())
    if x.size < 2:
        return Estimate(mean, None, None, 1)
    half = t95(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Estimate(mean, max(mean - half, bounds[0]), min(mean + half, bounds[1]), int(x.size))


def paired_difference(
    values: dict[str, float], base: dict[str, float], bounds: tuple[float, float] = (-math.inf, math.inf)
) -> Estimate | None:
    """Method minus baseline over the seeds both ran ({seed: value} each): the mean of the per-seed differences, which
    is the difference of the two means over those seeds, and its t-interval. None when they share no seed."""
    common = [s for s in values if s in base]
    return mean_interval([values[s] - base[s] for s in common], bounds) if common else None


def pearson_interval(x: np.ndarray, y: np.ndarray) -> Correlation | None:
    """Pearson r and its 95% interval by Fisher's z: tanh(atanh(r) -+ z(0.975) / sqrt(n - 3)). None with fewer than 4
    points or when either variable is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 4 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    r = float(np.corrcoef(x, y)[0, 1])
    # atanh(+-1) is infinite: a perfect correlation keeps its interval at the bound rather than turning into NaN
    z = math.atanh(min(max(r, -1 + 1e-12), 1 - 1e-12))
    half = t95(math.inf) / math.sqrt(x.size - 3)
    return Correlation(r, math.tanh(z - half), math.tanh(z + half), int(x.size))


def find_run(path: Path) -> Path:
    """The CSV or run folder that `path` names, or the single run folder below it."""
    if path.is_file():
        if path.suffix.lower() != ".csv":
            raise ValueError(f"{path}: expected a .csv file or a run folder")
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    if (path / "files" / "metrics.jsonl").exists() or (path / "metrics.jsonl").exists():
        return path
    found = sorted(p.parent.parent for p in path.glob("**/files/metrics.jsonl"))
    if len(found) != 1:
        what = "no run folder (files/metrics.jsonl)" if not found else f"{len(found)} run folders: {found}"
        raise ValueError(f"{path}: {what} below it; name one run folder")
    return found[0]


def parse_run(spec: str) -> Method:
    """One LABEL=PATH argument: a method with one run. group_methods merges the ones sharing a label."""
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = "", spec
    source = find_run(Path(path))
    return Method(label or Path(path).resolve().name.removesuffix(".csv"), [Run(source)])


def group_methods(parsed: list[Method]) -> list[Method]:
    """One method per label, in the order the labels first appear, its runs the seeds; each run gets its seed id."""
    methods: dict[str, Method] = {}
    for m in parsed:
        if m.label not in methods:
            methods[m.label] = m
            continue
        for run in m.runs:
            if any(r.source.resolve() == run.source.resolve() for r in methods[m.label].runs):
                raise ValueError(
                    f"{run.source} is given twice as {m.label}: a repeated label names one method's seeds, which "
                    "must be different runs (to plot one run twice, labels must differ)"
                )
        methods[m.label].runs.extend(m.runs)
    # the last seed<N> in the path (outputs/repro/kl_cov_seed2/wandb/offline-run-...) pairs seeds across methods;
    # unless every method's runs have distinct ones, every method pairs by order on the command line instead
    numbered = {}
    for m in methods.values():
        found = [re.findall(r"seed[_-]?(\d+)", str(r.source)) for r in m.runs]
        numbered[m.label] = [f"seed{int(f[-1])}" if f else "" for f in found]
    by_number = all("" not in ids and len(set(ids)) == len(ids) for ids in numbered.values())
    for m in methods.values():
        ids = numbered[m.label] if by_number else [f"run{i + 1}" for i in range(len(m.runs))]
        for run, seed in zip(m.runs, ids):
            run.seed = seed
    return list(methods.values())


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def fit_run(method: Method, fit_acc: str) -> None:
    """Fit the law on the method's (entropy, accuracy) pairs, every seed's; one that cannot be fitted gets a note."""
    keys = [fit_acc] if fit_acc != "auto" else [EVAL_ACC_KEY, TRAIN_ACC_KEY]
    last = "nothing to fit"
    for key in keys:
        try:
            h, r = method.pairs(ENTROPY_KEY, key)
            if fit_acc == "auto" and key == EVAL_ACC_KEY and h.size < 2:
                continue
            method.fit, method.fit_key, method.fit_points = fit_entropy_law(h, r), key, (h, r)
            return
        except ValueError as e:
            last = str(e)
    method.notes.append(f"no fit: {last}")


def across_runs(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """(steps, mean, min, max) per step over the runs that logged that step: runs of different lengths are fine."""
    by_step: dict[float, list[float]] = {}
    for steps, values in curves:
        for s, v in zip(steps, values):
            by_step.setdefault(float(s), []).append(float(v))
    steps = np.array(sorted(by_step))
    rows = [by_step[s] for s in steps]
    mean, low, high = (np.array([f(r) for r in rows]) for f in (np.mean, min, max))
    return steps, mean, low, high


def method_curves(method: Method, key: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The key's (steps, values) of each of the method's runs that logged it."""
    return [s for run in method.runs if (s := run.series(key)) is not None]


def cov_entropy_change(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(cov/mean at step t, entropy[t+1] - entropy[t]) over the steps t that hold both, t + 1 logging entropy.

    Both are measured by the trainer with the weights it holds at the start of the step, so the entropy difference of
    consecutive steps is the effect of step t's update, whose covariance is cov/mean[t]."""
    cov, ent = run.series(COV_KEY), run.series(ENTROPY_KEY)
    if cov is None or ent is None:
        return np.array([]), np.array([])
    h = dict(zip(ent[0].tolist(), ent[1].tolist()))
    points = [(c, h[s + 1] - h[s]) for s, c in zip(cov[0].tolist(), cov[1].tolist()) if s in h and s + 1 in h]
    return np.array([c for c, _ in points]), np.array([d for _, d in points])


def mechanism(methods: list[Method]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each method's (covariance, next entropy change) points over all its runs; methods without any are left out."""
    out = {}
    for m in methods:
        x, y = zip(*(cov_entropy_change(run) for run in m.runs))
        if sum(len(v) for v in x):
            out[m.label] = (np.concatenate(x), np.concatenate(y))
    return out


def pass_at_k_curves(methods: list[Method]) -> dict[str, list[tuple[int, Estimate]]]:
    """Per method, pass@k at each run's last evaluation: [(k, mean and interval over the runs that logged k)], k
    ascending. A run without pass@k is left out with a note; a method with none is left out of the result. A run
    whose last pass@k comes before its last step (no evaluation of its final weights) is kept, with a note."""
    found = {m.label: [run.pass_at_k() for run in m.runs] for m in methods}
    # runs from before pass@k existed, compared among themselves: nothing was asked of them, so no note
    asked = any(f for runs in found.values() for f in runs)
    curves = {}
    for m in methods:
        by_k: dict[int, list[float]] = {}
        for run, logged in zip(m.runs, found[m.label]):
            if asked and not logged:
                m.notes.append(f"{run.source}: no eval/pass@k logged: left out of pass@k")
            entropy = run.series(ENTROPY_KEY)
            at = max((step for step, _ in logged.values()), default=None)
            if at is not None and entropy is not None and at < entropy[0][-1]:
                m.notes.append(
                    f"{run.source}: its last pass@k is from step {at:g} of {entropy[0][-1]:g}: not the final weights"
                )
            for k, (_, value) in logged.items():
                by_k.setdefault(k, []).append(value)
        if by_k:
            curves[m.label] = [(k, mean_interval(v, (0.0, 1.0))) for k, v in sorted(by_k.items())]
    return curves


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, ax, path: Path) -> Path:
    if ax.get_legend_handles_labels()[0]:
        # Outside the axes: with four methods an inside legend hides the curves.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_runs(
    methods: list[Method],
    out_dir: Path,
    prefix: str = "",
    fit_acc: str = "auto",
    band: tuple[float, float] | None = None,
) -> list[Path]:
    """Write the figures; return their paths. Raises ValueError when no run logged entropy or accuracy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    seeds = any(len(m.runs) > 1 for m in methods)
    spread = " (mean over seeds, shaded: min-max)" if seeds else ""

    def name(m: Method, n: int) -> str:
        return f"{m.label} ({n} seeds)" if n > 1 else m.label

    plt, fig, ax = _figure(f"policy entropy{spread}", "step", f"entropy ({ENTROPY_KEY})")
    if band is not None:
        ax.axhspan(*band, color="0.85", zorder=0, label=f"target band [{band[0]:g}, {band[1]:g}]")
    for i, m in enumerate(methods):
        curves = method_curves(m, ENTROPY_KEY)
        if len(curves) < len(m.runs):
            m.notes.append(f"no {ENTROPY_KEY}" + (f" in {len(m.runs) - len(curves)} of its runs" if curves else ""))
        if not curves:
            continue
        steps, mean, low, high = across_runs(curves)
        ax.plot(steps, mean, color=f"C{i}", label=name(m, len(curves)))
        if len(curves) > 1:
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, lw=0)
        if len({len(c[0]) for c in curves}) > 1:
            lengths = ", ".join(str(len(c[0])) for c in curves)
            m.notes.append(f"its runs have {lengths} steps: the later steps of its curves average fewer runs")
    if not ax.lines:
        plt.close(fig)
        raise ValueError(f"none of the runs logged {ENTROPY_KEY}")
    written.append(_save(plt, fig, ax, out_dir / f"{prefix}entropy.png"))

    plt, fig, ax = _figure(f"accuracy{spread}", "step", "accuracy")
    for i, m in enumerate(methods):
        train, held_out = method_curves(m, TRAIN_ACC_KEY), method_curves(m, EVAL_ACC_KEY)
        if train:
            steps, mean, low, high = across_runs(train)
            # Faint: 16 samples a step make the training curve noisy; the held-out line is the one to read.
            label = f"{name(m, len(train))} (train {TRAIN_ACC_KEY})"
            ax.plot(steps, mean, color=f"C{i}", alpha=0.35, lw=1, label=label)
            if len(train) > 1:
                ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.08, lw=0)
        if held_out:
            steps, mean, low, high = across_runs(held_out)
            label = f"{name(m, len(held_out))} ({EVAL_ACC_KEY})"
            ax.plot(steps, mean, color=f"C{i}", ls="--", lw=2, marker="o", ms=4, label=label)
            if len(held_out) > 1:
                ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, lw=0)
        if not train and not held_out:
            m.notes.append(f"no {TRAIN_ACC_KEY} or {EVAL_ACC_KEY}")
    if not ax.lines:
        plt.close(fig)
        raise ValueError(f"none of the runs logged {TRAIN_ACC_KEY} or {EVAL_ACC_KEY}")
    written.append(_save(plt, fig, ax, out_dir / f"{prefix}accuracy.png"))

    curves = pass_at_k_curves(methods)
    if curves:
        bars = ", error bars: 95% t-interval over seeds" if seeds else ""
        plt, fig, ax = _figure(f"pass@k at the last evaluation{bars}", "k", "pass@k (eval/pass@k)")
        for i, m in enumerate(methods):
            if m.label not in curves:
                continue
            ks = [k for k, _ in curves[m.label]]
            est = [e for _, e in curves[m.label]]
            mean = np.array([e.mean for e in est])
            # a k logged by one seed only has no interval: a zero-length bar, not a missing point
            low = np.array([e.mean - e.low if e.low is not None else 0.0 for e in est])
            high = np.array([e.high - e.mean if e.high is not None else 0.0 for e in est])
            label = name(m, max(e.n for e in est))
            ax.errorbar(ks, mean, yerr=[low, high], color=f"C{i}", marker="o", ms=4, capsize=3, label=label)
        ax.set_xscale("log", base=2)
        all_k = sorted({k for c in curves.values() for k, _ in c})
        ax.set_xticks(all_k, [str(k) for k in all_k])
        written.append(_save(plt, fig, ax, out_dir / f"{prefix}pass_at_k.png"))

    points = mechanism(methods)
    if points:
        x = np.concatenate([p[0] for p in points.values()])
        y = np.concatenate([p[1] for p in points.values()])
        corr = pearson_interval(x, y)
        title = "entropy change vs covariance, all runs"
        if corr is not None:
            title += f": r = {corr.r:.2f}, 95% CI [{corr.low:.2f}, {corr.high:.2f}], n = {corr.n}"
        plt, fig, ax = _figure(title, f"{COV_KEY} at step t", f"{ENTROPY_KEY}[t+1] - [t]")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.axvline(0, color="0.5", lw=0.8)
        for i, m in enumerate(methods):
            if m.label in points:
                ax.scatter(*points[m.label], s=12, color=f"C{i}", alpha=0.7, label=m.label)
        if corr is not None:  # the least-squares line shows the sign the paper predicts (negative) at a glance
            slope, intercept = np.polyfit(x, y, 1)
            grid = np.linspace(float(x.min()), float(x.max()), 2)
            ax.plot(grid, slope * grid + intercept, color="k", lw=1, label=f"fit: slope {slope:.3g}")
        written.append(_save(plt, fig, ax, out_dir / f"{prefix}cov_entropy.png"))

    controlled = [(i, m) for i, m in enumerate(methods) if controller_moved(m)]
    if controlled:
        written.append(plot_knobs(controlled, out_dir / f"{prefix}knobs.png"))

    for m in methods:
        fit_run(m, fit_acc)
    fitted = [(i, m) for i, m in enumerate(methods) if m.fit is not None]
    if fitted:
        plt, fig, ax = _figure("entropy law R = -a exp(H) + b", "policy entropy H", "accuracy R")
        for i, m in fitted:
            h, r = m.fit_points
            ax.scatter(h, r, s=10, color=f"C{i}", alpha=0.6)
            grid = np.linspace(0.0, float(h.max()) * 1.05, 200)
            label = f"{m.label}: a={m.fit.a:.3g}, b={m.fit.b:.3g}"
            ax.plot(grid, m.fit.predict(grid), color=f"C{i}", label=label)
        written.append(_save(plt, fig, ax, out_dir / f"{prefix}entropy_law.png"))
        for _, m in fitted:
            path = out_dir / f"{prefix}fit_{safe_name(m.label)}.png"
            plot_fit(*m.fit_points, m.fit, path, title=f"{m.label}: {m.fit_key} vs {ENTROPY_KEY}")
            written.append(path)
    return written


def controller_moved(m: Method) -> bool:
    """Whether the entropy controller of some run of `m` moved a knob (scale off 1 or a bonus above 0)."""
    for run in m.runs:
        scale, bonus = run.series(KNOB_KEYS[0]), run.series(KNOB_KEYS[1])
        if (scale is not None and np.any(scale[1] != 1.0)) or (bonus is not None and np.any(bonus[1] > 0)):
            return True
    return False


def plot_knobs(controlled: list[tuple[int, Method]], path: Path) -> Path:
    """The controller's two knobs over the steps, one line per run (seeds share their method's colour): the scale
    on the objective's own knob (log axis; 1 = its base setting) and the entropy bonus's coefficient."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 5.5), sharex=True)
    top.set_title("entropy controller: what it set at each step (one line per run)")
    top.set_ylabel("objective knob scale")
    top.set_yscale("log", base=2)
    top.axhline(1.0, color="0.5", lw=0.8)
    bottom.set_ylabel("entropy bonus coef")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    for i, m in controlled:
        for j, run in enumerate(m.runs):
            label = m.label if j == 0 else None
            for ax, key in zip((top, bottom), KNOB_KEYS):
                series = run.series(key)
                if series is not None:
                    ax.plot(*series, color=f"C{i}", lw=1.2, alpha=0.8, label=label)
    return _save(plt, fig, top, path)  # the legend beside the top panel, as every figure's


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


def final_value(run: Run, key: str, last: int) -> float | None:
    """Mean of the metric over the run's last `last` logged values (one step is noisy), or None if never logged."""
    s = run.series(key)
    return None if s is None else float(np.mean(s[1][-last:]))


def share_in_band(run: Run, band: tuple[float, float], last: int | None = None, from_step: float = 0) -> float | None:
    """The share of the run's entropy values inside the band (ends included), over its last `last` steps or, without
    `last`, every step from `from_step` on; None if it never logged entropy there."""
    s = run.series(ENTROPY_KEY)
    if s is None:
        return None
    tail = s[1][-last:] if last else s[1][s[0] >= from_step]
    return float(np.mean((tail >= band[0]) & (tail <= band[1]))) if tail.size else None


def band_ceiling(run: Run, band: tuple[float, float], from_step: float = 0) -> tuple[float, float] | None:
    """How well any controller could score on this run's batches: (sigma, share). sigma estimates the noise of one
    step's entropy reading as the standard deviation of the step-to-step changes over sqrt(2) (each change holds
    two readings' noise; real drift between steps makes it an upper bound); share is the chance that a reading
    lands inside the band when the true entropy sits at the band's centre, with normal noise of that sigma. None
    with fewer than 3 readings from `from_step` on."""
    s = run.series(ENTROPY_KEY)
    if s is None:
        return None
    values = s[1][s[0] >= from_step]
    if values.size < 3:
        return None
    sigma = float(np.std(np.diff(values), ddof=1) / math.sqrt(2))
    half = (band[1] - band[0]) / 2
    share = math.erf(half / (sigma * math.sqrt(2))) if sigma > 0 else 1.0
    return sigma, share


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


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def results_table(methods: list[Method], baseline: str, last: int = 10, band: tuple[float, float] | None = None) -> str:
    """docs/results.md's table for one run per method, in markdown: final entropy, accuracies and the entropy ratio
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
            f"| {label} | {_fmt(None if steps is None else len(steps[0]), 'd')} | {_fmt(h, '.4f')} "
            f"| {_fmt(ratio, '.2f')} | {_fmt(final_value(run, TRAIN_ACC_KEY, last), '.3f')} "
            f"| {_fmt(final_value(run, EVAL_ACC_KEY, 1), '.3f')} |"
            + ("" if band is None else f" {_fmt(share_in_band(run, band, last), '.0%')} |")
        )
    return "\n".join(lines)


def seed_values(
    method: Method, last: int = 10, band: tuple[float, float] | None = None, band_from: float = 5
) -> dict[str, dict[str, float]]:
    """{metric: {seed: that run's value}}: entropy and train accuracy over its last `last` steps, held-out accuracy
    and pass@k at its last evaluation, the share of steps from `band_from` on inside the band (metric "band"). A run
    that did not log a metric is missing from that metric's dict."""
    values: dict[str, dict[str, float]] = {}
    for run in method.runs:
        found = {
            ENTROPY_KEY: final_value(run, ENTROPY_KEY, last),
            TRAIN_ACC_KEY: final_value(run, TRAIN_ACC_KEY, last),
            EVAL_ACC_KEY: final_value(run, EVAL_ACC_KEY, 1),
            BAND: None if band is None else share_in_band(run, band, from_step=band_from),
        }
        found.update({f"eval/pass@{k}": v for k, (_, v) in run.pass_at_k().items()})
        for metric, value in found.items():
            if value is not None:
                values.setdefault(metric, {})[run.seed] = value
    return values


def _fmt_estimate(est: Estimate | None, spec: str) -> str:
    if est is None:
        return "n/a"
    if est.low is None:
        return format(est.mean, spec)
    return f"{est.mean:{spec}} [{est.low:{spec}}, {est.high:{spec}}]"


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
    t-interval; the entropy ratio is that of the means."""
    values = {m.label: seed_values(m, last, band, band_from) for m in methods}
    base = _estimate(values.get(baseline, {}), ENTROPY_KEY)
    band_head = "" if band is None else f" in [{band[0]:g}, {band[1]:g}] (step >= {band_from:g}) |"
    lines = [
        f"| method | seeds | steps | entropy (last {last}) | entropy / {baseline} | train acc (last {last}) "
        f"| test acc (last eval) |{band_head}",
        "|---|---|---|---|---|---|---|" + ("" if band is None else "---|"),
    ]
    for m in methods:
        v = values[m.label]
        lengths = sorted({len(c[0]) for c in method_curves(m, ENTROPY_KEY)})
        steps = "n/a" if not lengths else "-".join(str(n) for n in dict.fromkeys([lengths[0], lengths[-1]]))
        h, train, test = (_estimate(v, key) for key in (ENTROPY_KEY, TRAIN_ACC_KEY, EVAL_ACC_KEY))
        ratio = h.mean / base.mean if h is not None and base is not None and base.mean else None
        lines.append(
            f"| {m.label} | {len(m.runs)} | {steps} | {_fmt_estimate(h, '.3f')} | {_fmt(ratio, '.2f')} "
            f"| {_fmt_estimate(train, '.3f')} | {_fmt_estimate(test, '.3f')} |"
            + ("" if band is None else f" {_fmt_estimate(_estimate(v, BAND), '.0%')} |")
        )
    return "\n".join(lines)


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
            cells = [_fmt(h, ".3f"), _fmt(ratio, ".2f")]
            cells += [_fmt(v.get(f"eval/pass@{k}", {}).get(seed), ".3f") for k in top]
            if band is not None:
                cells.append(_fmt(v.get(BAND, {}).get(seed), ".0%"))
            lines.append(f"| {seed.removeprefix('seed') or '?'} | {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# What a token-selecting objective logs per step (loss_terms.py): the share of tokens it selected, for Clip-Cov the
# share inside its bounds (its candidates), and whether its micro-batches selected nothing or only the floor.
SELECTED_KEYS = ("loss/clip_cov_frac", "loss/kl_cov_frac")
IN_BOUNDS_KEY = "loss/clip_cov_in_bounds"
STARVED_KEY = "loss/select_starved"


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
            cells = [_fmt(selected, ".2%"), _fmt(inside, ".2%"), _fmt(share, ".0%"), _fmt(starved, ".0%")]
            lines.append(f"| {run.seed.removeprefix('seed') or '?'} | {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def pass_at_k_table(curves: dict[str, list[tuple[int, Estimate]]]) -> str:
    """pass@k at the last evaluation, one row per method, one column per k any run logged."""
    ks = sorted({k for c in curves.values() for k, _ in c})
    lines = ["| method | runs | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---|---|" + "---|" * len(ks)]
    for label, curve in curves.items():
        by_k = dict(curve)
        cells = " | ".join(_fmt_estimate(by_k.get(k), ".3f") for k in ks)
        lines.append(f"| {label} | {max(e.n for _, e in curve)} | {cells} |")
    return "\n".join(lines)


def paired_table(
    methods: list[Method],
    baseline: str,
    last: int = 10,
    band: tuple[float, float] | None = None,
    band_from: float = 5,
) -> str:
    """Each method minus the baseline, paired by seed, in markdown: the mean difference, its 95% t-interval over the
    seed pairs, and whether the interval excludes 0."""
    values = {m.label: seed_values(m, last, band, band_from) for m in methods}
    if baseline not in values:
        return f"no method is labelled {baseline!r}: no paired comparison (--baseline)"
    if len(values) == 1:
        return ""  # the baseline alone: nothing to compare
    base = values[baseline]
    names = {ENTROPY_KEY: f"entropy (last {last})", TRAIN_ACC_KEY: f"train acc (last {last})"}
    names[EVAL_ACC_KEY] = "test acc (last eval)"
    if band is not None:
        names[BAND] = f"in [{band[0]:g}, {band[1]:g}] (step >= {band_from:g})"
    ks = sorted({int(PASS_AT_K.fullmatch(k).group(1)) for v in values.values() for k in v if PASS_AT_K.fullmatch(k)})
    names.update({f"eval/pass@{k}": f"pass@{k}" for k in ks})
    lines = [
        f"| method - {baseline} | metric | difference | 95% interval | seed pairs | |",
        "|---|---|---|---|---|---|",
    ]
    base_seeds = {run.seed for m in methods if m.label == baseline for run in m.runs}
    for m in methods:
        if m.label == baseline:
            continue
        if not base_seeds & {run.seed for run in m.runs}:
            m.notes.append(
                f"no seed in common with {baseline}, not compared (seeds pair by the seed<N> in their paths)"
            )
            continue
        for metric, title in names.items():
            if metric not in values[m.label] or metric not in base:
                continue
            bounds = (-math.inf, math.inf) if metric == ENTROPY_KEY else (-1.0, 1.0)
            d = paired_difference(values[m.label][metric], base[metric], bounds)
            if d is None:  # both logged it, but in different seeds
                continue
            spec = "+.0%" if metric == BAND else "+.3f"
            if d.low is None:
                interval, verdict = "n/a", "one seed pair: no interval"
            else:
                interval = f"[{d.low:{spec}}, {d.high:{spec}}]"
                significant = d.low > 0 or d.high < 0
                verdict = "excludes 0" if significant else f"not significant at {d.n} seeds"
            lines.append(f"| {m.label} | {title} | {d.mean:{spec}} | {interval} | {d.n} | {verdict} |")
    return "\n".join(lines) if len(lines) > 2 else f"no paired comparison: no method shares a seed with {baseline}"


def mechanism_table(methods: list[Method]) -> str:
    """Pearson r of cov/mean[t] against entropy[t+1] - entropy[t], over all runs and per method, with Fisher
    intervals; empty when no run logged the covariance."""
    points = mechanism(methods)
    if not points:
        return ""
    groups = {"all": tuple(np.concatenate(v) for v in zip(*points.values()))} if len(points) > 1 else {}
    groups.update(points)
    lines = [
        f"mechanism: {COV_KEY} at step t against {ENTROPY_KEY}[t+1] - [t] (the paper: the change follows minus the "
        "covariance, r < 0)",
        "| runs | points | Pearson r | 95% interval (Fisher z) |",
        "|---|---|---|---|",
    ]
    for label, (x, y) in groups.items():
        c = pearson_interval(x, y)
        if c is None:
            lines.append(f"| {label} | {len(x)} | n/a | n/a (fewer than 4 points, or a constant) |")
        else:
            lines.append(f"| {label} | {c.n} | {c.r:+.3f} | [{c.low:+.3f}, {c.high:+.3f}] |")
    return "\n".join(lines)


def parse_band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--band: expected LO,HI (two numbers), got {text!r}") from None
    if not lo < hi:
        raise ValueError(f"--band: LO must be below HI, got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="a run folder, a folder with one run, or a CSV")
    p.add_argument("--out", default="docs", help="folder the PNGs go in")
    p.add_argument("--prefix", default="", help="file-name prefix of the PNGs, e.g. arith_")
    p.add_argument("--fit-acc", default="auto", help=f"accuracy metric of the fit: auto | {EVAL_ACC_KEY} | ...")
    p.add_argument("--baseline", default="grpo", help="label of the method the others are compared with")
    p.add_argument("--last", type=int, default=10, help="the table averages each metric over the last N steps")
    p.add_argument("--band", default="", metavar="LO,HI", help="an entropy target band to shade and score runs by")
    p.add_argument("--band-from", type=float, default=5, help="with seeds, the band share counts steps from this on")
    args = p.parse_args(argv)
    try:
        band = parse_band(args.band) if args.band else None
        methods = group_methods([parse_run(spec) for spec in args.runs])
        written = plot_runs(methods, Path(args.out), args.prefix, args.fit_acc, band)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if any(len(m.runs) > 1 for m in methods):
        print(seeds_table(methods, args.baseline, args.last, band, args.band_from))
        paired = paired_table(methods, args.baseline, args.last, band, args.band_from)
        if paired:
            print()
            print(paired)
        print()
        print(per_seed_table(methods, args.baseline, args.last, band, args.band_from))
        if selection := selection_table(methods):
            print()
            print(selection)
    else:
        print(results_table(methods, args.baseline, args.last, band))
    if band is not None:
        print()
        print(ceiling_table(methods, band, args.band_from))
    curves = pass_at_k_curves(methods)
    if curves:
        print()
        print(pass_at_k_table(curves))
    print()
    print(fit_table(methods))
    mech = mechanism_table(methods)
    if mech:
        print()
        print(mech)
    for m in methods:
        for note in dict.fromkeys(m.notes):  # pass@k is looked at by both the plot and the table: one note each
            print(f"note: {m.label}: {note}")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
