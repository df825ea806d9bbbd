"""The study's figures, as PNGs: entropy and accuracy against step, pass@k against k, the mechanism check (each
step's covariance against the next entropy change), the entropy controller's knobs and the entropy law's fits."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from entropy_openrlhf.algorithms.entropy_law import plot_fit
from study.runs import (
    COV_KEY,
    ENTROPY_KEY,
    EVAL_ACC_KEY,
    KNOB_KEYS,
    TRAIN_ACC_KEY,
    Method,
    across_runs,
    controller_moved,
    fit_run,
    mechanism,
    method_curves,
    pass_at_k_curves,
    pooled,
    safe_name,
)
from study.stats import Estimate, pearson_interval


def _figure(title: str, xlabel: str, ylabel: str):
    matplotlib.use("Agg")  # files only, never a window (no display where the runs are)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path) -> Path:
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

    fig, ax = _figure(f"policy entropy{spread}", "step", f"entropy ({ENTROPY_KEY})")
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
    written.append(_save(fig, ax, out_dir / f"{prefix}entropy.png"))

    fig, ax = _figure(f"accuracy{spread}", "step", "accuracy")
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
    written.append(_save(fig, ax, out_dir / f"{prefix}accuracy.png"))

    curves = pass_at_k_curves(methods)
    if curves:
        bars = ", error bars: 95% t-interval over seeds" if seeds else ""
        fig, ax = _figure(f"pass@k at the last evaluation{bars}", "k", "pass@k (eval/pass@k)")
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
        written.append(_save(fig, ax, out_dir / f"{prefix}pass_at_k.png"))

    points = {label: pooled(runs) for label, runs in mechanism(methods).items()}
    if points:
        x = np.concatenate([p.cov for p in points.values()])
        y = np.concatenate([p.change for p in points.values()])
        corr = pearson_interval(x, y)
        title = "entropy change vs covariance, all runs"
        if corr is not None:
            title += f": r = {corr.r:.2f}, 95% CI [{corr.low:.2f}, {corr.high:.2f}], n = {corr.n}"
        fig, ax = _figure(title, f"{COV_KEY} at step t", f"{ENTROPY_KEY}[t+1] - [t]")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.axvline(0, color="0.5", lw=0.8)
        for i, m in enumerate(methods):
            if m.label in points:
                ax.scatter(points[m.label].cov, points[m.label].change, s=12, color=f"C{i}", alpha=0.7, label=m.label)
        if corr is not None:  # the least-squares line shows the sign the paper predicts (negative) at a glance
            slope, intercept = np.polyfit(x, y, 1)
            grid = np.linspace(float(x.min()), float(x.max()), 2)
            ax.plot(grid, slope * grid + intercept, color="k", lw=1, label=f"fit: slope {slope:.3g}")
        written.append(_save(fig, ax, out_dir / f"{prefix}cov_entropy.png"))

    controlled = [(i, m) for i, m in enumerate(methods) if controller_moved(m)]
    if controlled:
        written.append(plot_knobs(controlled, out_dir / f"{prefix}knobs.png"))

    for m in methods:
        fit_run(m, fit_acc)
    fitted = [(i, m) for i, m in enumerate(methods) if m.fit is not None]
    if fitted:
        fig, ax = _figure("entropy law R = -a exp(H) + b", "policy entropy H", "accuracy R")
        for i, m in fitted:
            h, r = m.fit_points
            ax.scatter(h, r, s=10, color=f"C{i}", alpha=0.6)
            grid = np.linspace(0.0, float(h.max()) * 1.05, 200)
            label = f"{m.label}: a={m.fit.a:.3g}, b={m.fit.b:.3g}"
            ax.plot(grid, m.fit.predict(grid), color=f"C{i}", label=label)
        written.append(_save(fig, ax, out_dir / f"{prefix}entropy_law.png"))
        for _, m in fitted:
            path = out_dir / f"{prefix}fit_{safe_name(m.label)}.png"
            plot_fit(*m.fit_points, m.fit, path, title=f"{m.label}: {m.fit_key} vs {ENTROPY_KEY}")
            written.append(path)
    return written


def plot_knobs(controlled: list[tuple[int, Method]], path: Path) -> Path:
    """The controller's two knobs over the steps, one line per run (seeds share their method's colour): the scale
    on the objective's own knob (log axis; 1 = its base setting) and the entropy bonus's coefficient."""
    matplotlib.use("Agg")  # files only, never a window (no display where the runs are)
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
    return _save(fig, top, path)  # the legend beside the top panel, as every figure's


def plot_explore(
    base: dict[int, float], curves: dict[str, dict[str, list[tuple[int, Estimate]]]], pairs: int, path: Path
) -> Path:
    """The exploration experiment's pass@k against k (log2 axis): the base model's one evaluation as a black line and
    each arm's curves (study.explore.pass_at_k_by_arm) as means with 95% t-interval bars, the final weights solid and
    the midway ones dashed, in the arm's colour."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = _figure(f"pass@k on the shared held-out set ({pairs} seed pairs; bars: 95% t-interval)", "k", "pass@k")
    ks = sorted(base)
    ax.plot(ks, [base[k] for k in ks], color="black", marker="s", ms=4, label="base model")
    for i, (arm, by_time) in enumerate(curves.items()):
        for when, points in by_time.items():
            final = when == "final"
            mean = np.array([e.mean for _, e in points])
            low = np.array([e.mean - e.low if e.low is not None else 0.0 for _, e in points])
            high = np.array([e.high - e.mean if e.high is not None else 0.0 for _, e in points])
            ax.errorbar([k for k, _ in points], mean, yerr=[low, high], color=f"C{i}", ls="-" if final else "--",
                        alpha=1.0 if final else 0.5, marker="o", ms=4, capsize=3, label=f"{arm} ({when})")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    return _save(fig, ax, path)
