"""The paper's empirical law R = -a * exp(H) + b between policy entropy H and validation performance R.

At H = 0 (entropy exhausted) the law predicts the ceiling R = b - a. Fitting on the first steps of a run and
extrapolating along the entropy axis forecasts later accuracy (arXiv 2505.22617; docs/algorithms/losses.md, 'The
entropy law').
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy.optimize import OptimizeWarning, curve_fit


@dataclass
class EntropyLawFit:
    a: float
    b: float
    rmse: float
    n_points: int

    @property
    def ceiling(self) -> float:
        """Predicted performance when entropy reaches 0."""
        return self.b - self.a

    def predict(self, entropy: np.ndarray | float) -> np.ndarray | float:
        return -self.a * np.exp(entropy) + self.b


def _law(h, a, b):
    return -a * np.exp(h) + b


def fit_entropy_law(entropy: np.ndarray, perf: np.ndarray) -> EntropyLawFit:
    """Least-squares fit of R = -a exp(H) + b. The law is linear in (a, b), so it has a closed-form solution; scipy's
    curve_fit refines it (and is what users expect to see) starting from there."""
    h = np.asarray(entropy, dtype=float)
    r = np.asarray(perf, dtype=float)
    keep = np.isfinite(h) & np.isfinite(r)
    h, r = h[keep], r[keep]
    if h.size < 2:
        raise ValueError(f"need at least 2 finite (entropy, accuracy) points to fit, got {h.size}")
    if np.unique(h).size < 2:
        raise ValueError(f"all {h.size} points have the same entropy {h[0]:g}: a and b cannot be separated")
    design = np.stack([-np.exp(h), np.ones_like(h)], axis=1)
    (a0, b0), *_ = np.linalg.lstsq(design, r, rcond=None)
    with warnings.catch_warnings():
        # with 2 points (an exact fit) scipy cannot estimate the parameter covariance; it is not used here
        warnings.simplefilter("ignore", OptimizeWarning)
        (a, b), _ = curve_fit(_law, h, r, p0=(a0, b0), maxfev=10_000)
    rmse = float(math.sqrt(np.mean((_law(h, a, b) - r) ** 2)))
    return EntropyLawFit(float(a), float(b), rmse, int(h.size))


def forecast(entropy: np.ndarray, perf: np.ndarray, fit_points: int) -> dict[str, float]:
    """Fit on the first `fit_points` (entropy, accuracy) pairs and score the prediction of the rest."""
    h = np.asarray(entropy, dtype=float)
    r = np.asarray(perf, dtype=float)
    if not 2 <= fit_points < h.size:
        raise ValueError(f"fit_points={fit_points} must be at least 2 and less than the {h.size} points available")
    law = fit_entropy_law(h[:fit_points], r[:fit_points])
    pred = law.predict(h[fit_points:])
    return {
        "a": law.a,
        "b": law.b,
        "ceiling": law.ceiling,
        "fit_rmse": law.rmse,
        "forecast_rmse": float(np.sqrt(np.mean((pred - r[fit_points:]) ** 2))),
        "final_predicted": float(pred[-1]),
        "final_actual": float(r[-1]),
    }


def read_csv(path: str | Path, entropy_key: str, perf_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows with both columns present and numeric, in file order (sorted by `step` when there is one)."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for name in (entropy_key, perf_key):
            if reader.fieldnames is None or name not in reader.fieldnames:
                raise ValueError(f"{path}: no column {name!r}; columns are {reader.fieldnames}")
        for row in reader:
            try:
                rows.append((float(row.get("step") or len(rows)), float(row[entropy_key]), float(row[perf_key])))
            except (TypeError, ValueError):
                continue  # a step where one of the two was not logged
    return _sorted_pairs(rows, path)


def read_wandb_offline(run_dir: str | Path, entropy_key: str, perf_key: str) -> tuple[np.ndarray, np.ndarray]:
    """(entropy, accuracy) pairs from a run folder: the trainer writes every logged step as one JSON line to
    `<output_dir>/metrics.jsonl`. Runs from before that kept it in their W&B offline folder, as `files/metrics.jsonl`
    (wandb 0.31 cannot read its binary run file back from Python); such a folder is read too.
    """
    run_dir = Path(run_dir)
    candidates = [run_dir / "metrics.jsonl", run_dir / "files" / "metrics.jsonl"]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run's output folder, written by our trainer?)")
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if entropy_key in rec and perf_key in rec:
                rows.append((float(rec.get("step", len(rows))), float(rec[entropy_key]), float(rec[perf_key])))
    return _sorted_pairs(rows, path)


def _sorted_pairs(rows, source) -> tuple[np.ndarray, np.ndarray]:
    if not rows:
        raise ValueError(f"{source}: no rows hold both the entropy and the accuracy metric")
    rows.sort(key=lambda x: x[0])
    return np.array([x[1] for x in rows]), np.array([x[2] for x in rows])


def plot_fit(entropy: np.ndarray, perf: np.ndarray, law: EntropyLawFit, out_png: str | Path, title: str = "") -> None:
    # a Figure of its own, drawn by the Agg canvas: no pyplot, so no GUI backend and no global figure state
    fig = Figure(figsize=(5, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.scatter(entropy, perf, s=14, label="run")
    grid = np.linspace(0.0, max(float(np.max(entropy)), 1e-3) * 1.05, 200)
    ax.plot(grid, law.predict(grid), color="C1", label=f"R = -{law.a:.3g} exp(H) + {law.b:.3g}")
    ax.axhline(law.ceiling, color="C1", ls=":", lw=1, label=f"ceiling b - a = {law.ceiling:.3g}")
    ax.set_xlabel("policy entropy H")
    ax.set_ylabel("accuracy R")
    ax.set_title(title or f"entropy law fit (RMSE {law.rmse:.3g})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
