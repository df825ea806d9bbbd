"""Plot several runs side by side, one line per method: entropy and accuracy against step, and the entropy law
R = -a exp(H) + b fitted per method.

    python scripts/plot_runs.py grpo=outputs/grpo kl_cov=outputs/kl_cov clip_cov=runs/clip_cov.csv --out docs/

Each run is LABEL=PATH (or just PATH: the label is then the folder or file name). PATH is a W&B offline run folder
written by our trainer (it holds files/metrics.jsonl), a folder with exactly one such run below it (a pipeline's
--train.output_dir), or a CSV with a `step` column and one column per metric.

Writes into --out:
    <prefix>entropy.png       `entropy/seq_mean` against step
    <prefix>accuracy.png      `reward/acc` (solid) and, where logged, `eval/acc` (dashed) against step
    <prefix>entropy_law.png   accuracy against entropy with each method's fitted law
    <prefix>fit_<label>.png   one method's fit (entropy_law.plot_fit)
and prints a markdown table of each method's final entropy, accuracies and entropy ratio to --baseline (the table
of docs/results.md), then each method's fit (a, b, the ceiling b - a, RMSE). The fit uses `--fit-acc`; `auto` is
`eval/acc` when the run has at least two evaluations, else `reward/acc`.

`--band LO,HI` (an entropy controller's `--entropy.target`) shades the band on the entropy plot and adds a column
to the table: the share of each run's last N steps whose entropy was inside it.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from entropy_openrlhf.algorithms.entropy_law import (
    EntropyLawFit,
    fit_entropy_law,
    plot_fit,
    read_csv,
    read_wandb_offline,
)

ENTROPY_KEY = "entropy/seq_mean"
TRAIN_ACC_KEY = "reward/acc"
EVAL_ACC_KEY = "eval/acc"


@dataclass
class Run:
    label: str
    source: Path  # a CSV file or a run folder holding files/metrics.jsonl
    fit: EntropyLawFit | None = None
    fit_key: str = ""
    fit_points: tuple[np.ndarray, np.ndarray] | None = None
    notes: list[str] = field(default_factory=list)

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


def parse_run(spec: str) -> Run:
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = "", spec
    source = find_run(Path(path))
    return Run(label or Path(path).resolve().name.removesuffix(".csv"), source)


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def fit_run(run: Run, fit_acc: str) -> None:
    """Fit the law on the run's (entropy, accuracy) pairs; a run that cannot be fitted gets a note instead."""
    keys = [fit_acc] if fit_acc != "auto" else [EVAL_ACC_KEY, TRAIN_ACC_KEY]
    last = "nothing to fit"
    for key in keys:
        try:
            h, r = run.pairs(ENTROPY_KEY, key)
            if fit_acc == "auto" and key == EVAL_ACC_KEY and h.size < 2:
                continue
            run.fit, run.fit_key, run.fit_points = fit_entropy_law(h, r), key, (h, r)
            return
        except ValueError as e:
            last = str(e)
    run.notes.append(f"no fit: {last}")


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
    runs: list[Run],
    out_dir: Path,
    prefix: str = "",
    fit_acc: str = "auto",
    band: tuple[float, float] | None = None,
) -> list[Path]:
    """Write the figures; return their paths. Raises ValueError when no run logged entropy or accuracy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    plt, fig, ax = _figure("policy entropy", "step", f"entropy ({ENTROPY_KEY})")
    if band is not None:
        ax.axhspan(*band, color="0.85", zorder=0, label=f"target band [{band[0]:g}, {band[1]:g}]")
    for i, run in enumerate(runs):
        s = run.series(ENTROPY_KEY)
        if s is None:
            run.notes.append(f"no {ENTROPY_KEY}")
            continue
        ax.plot(*s, color=f"C{i}", label=run.label)
    if not ax.lines:
        plt.close(fig)
        raise ValueError(f"none of the runs logged {ENTROPY_KEY}")
    written.append(_save(plt, fig, ax, out_dir / f"{prefix}entropy.png"))

    plt, fig, ax = _figure("accuracy", "step", "accuracy")
    for i, run in enumerate(runs):
        train, held_out = run.series(TRAIN_ACC_KEY), run.series(EVAL_ACC_KEY)
        if train is not None:
            # Faint: 16 samples a step make the training curve noisy; the held-out line is the one to read.
            ax.plot(*train, color=f"C{i}", alpha=0.35, lw=1, label=f"{run.label} (train {TRAIN_ACC_KEY})")
        if held_out is not None:
            ax.plot(*held_out, color=f"C{i}", ls="--", lw=2, marker="o", ms=4, label=f"{run.label} ({EVAL_ACC_KEY})")
        if train is None and held_out is None:
            run.notes.append(f"no {TRAIN_ACC_KEY} or {EVAL_ACC_KEY}")
    if not ax.lines:
        plt.close(fig)
        raise ValueError(f"none of the runs logged {TRAIN_ACC_KEY} or {EVAL_ACC_KEY}")
    written.append(_save(plt, fig, ax, out_dir / f"{prefix}accuracy.png"))

    for run in runs:
        fit_run(run, fit_acc)
    fitted = [(i, run) for i, run in enumerate(runs) if run.fit is not None]
    if fitted:
        plt, fig, ax = _figure("entropy law R = -a exp(H) + b", "policy entropy H", "accuracy R")
        for i, run in fitted:
            h, r = run.fit_points
            ax.scatter(h, r, s=10, color=f"C{i}", alpha=0.6)
            grid = np.linspace(0.0, float(h.max()) * 1.05, 200)
            label = f"{run.label}: a={run.fit.a:.3g}, b={run.fit.b:.3g}"
            ax.plot(grid, run.fit.predict(grid), color=f"C{i}", label=label)
        written.append(_save(plt, fig, ax, out_dir / f"{prefix}entropy_law.png"))
        for _, run in fitted:
            path = out_dir / f"{prefix}fit_{safe_name(run.label)}.png"
            plot_fit(*run.fit_points, run.fit, path, title=f"{run.label}: {run.fit_key} vs {ENTROPY_KEY}")
            written.append(path)
    return written


def fit_table(runs: list[Run]) -> str:
    lines = [f"{'method':<16}{'accuracy key':<14}{'points':>7}{'a':>10}{'b':>10}{'b - a':>10}{'rmse':>10}"]
    for run in runs:
        if run.fit is None:
            lines.append(f"{run.label:<16}not fitted (see the notes below)")
            continue
        f = run.fit
        lines.append(
            f"{run.label:<16}{run.fit_key:<14}{f.n_points:>7}{f.a:>10.4g}{f.b:>10.4g}{f.ceiling:>10.4g}{f.rmse:>10.3g}"
        )
    return "\n".join(lines)


def final_value(run: Run, key: str, last: int) -> float | None:
    """Mean of the metric over the run's last `last` logged values (one step is noisy), or None if never logged."""
    s = run.series(key)
    return None if s is None else float(np.mean(s[1][-last:]))


def share_in_band(run: Run, band: tuple[float, float], last: int) -> float | None:
    """The share of the run's last `last` entropy values inside the band (ends included), or None if never logged."""
    s = run.series(ENTROPY_KEY)
    if s is None:
        return None
    tail = s[1][-last:]
    return float(np.mean((tail >= band[0]) & (tail <= band[1])))


def results_table(runs: list[Run], baseline: str, last: int = 10, band: tuple[float, float] | None = None) -> str:
    """docs/results.md's table, in markdown: final entropy, accuracies and the entropy ratio to the baseline run;
    with a band, also the share of the last steps whose entropy was inside it."""
    base = next((r for r in runs if r.label == baseline), None)
    base_h = final_value(base, ENTROPY_KEY, last) if base else None

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    band_head = "" if band is None else f" in [{band[0]:g}, {band[1]:g}] (last {last}) |"
    lines = [
        f"| method | steps | entropy (last {last}) | entropy / {baseline} | train acc (last {last}) "
        f"| test acc (last eval) |{band_head}",
        "|---|---|---|---|---|---|" + ("" if band is None else "---|"),
    ]
    for run in runs:
        h = final_value(run, ENTROPY_KEY, last)
        steps = run.series(ENTROPY_KEY)
        ratio = h / base_h if h is not None and base_h else None
        lines.append(
            f"| {run.label} | {fmt(None if steps is None else len(steps[0]), 'd')} | {fmt(h, '.4f')} "
            f"| {fmt(ratio, '.2f')} | {fmt(final_value(run, TRAIN_ACC_KEY, last), '.3f')} "
            f"| {fmt(final_value(run, EVAL_ACC_KEY, 1), '.3f')} |"
            + ("" if band is None else f" {fmt(share_in_band(run, band, last), '.0%')} |")
        )
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
    p.add_argument("--baseline", default="grpo", help="label of the run the entropy ratios are taken against")
    p.add_argument("--last", type=int, default=10, help="the table averages each metric over the last N steps")
    p.add_argument("--band", default="", metavar="LO,HI", help="an entropy target band to shade and score runs by")
    args = p.parse_args(argv)
    try:
        band = parse_band(args.band) if args.band else None
        runs = [parse_run(spec) for spec in args.runs]
        labels = [r.label for r in runs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels must differ, got {labels}: name them LABEL=PATH")
        written = plot_runs(runs, Path(args.out), args.prefix, args.fit_acc, band)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(results_table(runs, args.baseline, args.last, band))
    print()
    print(fit_table(runs))
    for run in runs:
        for note in run.notes:
            print(f"note: {run.label}: {note}")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
