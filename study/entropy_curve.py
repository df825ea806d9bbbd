"""Exploratory, chosen after every run was in: does KL-Cov move along GRPO's entropy-performance curve, or sit above
it? The paper's law R = -a exp(H) + b (entropy_openrlhf/algorithms/entropy_law.py) is fitted per arm on the
(entropy, held-out accuracy) points of its evaluations, every seed pooled; then KL-Cov's points are held against
GRPO's curve.

    python -m study.entropy_curve                     # both experiments, eval/acc (greedy held-out accuracy)
    python -m study.entropy_curve --acc eval/pass@1   # the sampled accuracy instead

Two experiments, GRPO and KL-Cov paired by seed (1-7):
- levels 1-3, 25 steps (study/runs/{grpo,kl_cov}_seed<N>): evaluations of policy versions 0, 13 and 25;
- the exploration experiment, levels 3-4, 50 steps (explore_{grpo,kl_cov}_seed<N>): versions 25 and 50, and
  version 0 as the base model's evaluation of the shared held-out set (study/runs/explore_base/metrics.json)
  beside each run's step-0 entropy.

Each point pairs the evaluation's accuracy with `entropy/seq_mean` of the row it is logged in (the entropy of the
rollouts of that step), as scripts/fit_entropy_law.py pairs them.

Printed, per experiment: each arm's fit (a, b, the ceiling b - a, RMSE) with 95% intervals from a paired-seed
bootstrap; the gap, the mean over KL-Cov's trained points (version > 0) of its accuracy minus GRPO's curve at its
entropy (0: on GRPO's curve; above 0: above it), with the same bootstrap's interval, over all trained points and
over the final weights alone; GRPO's own mean residual on its trained points beside it; and each arm's mean final
entropy and accuracy. The bootstrap resamples the seven seeds with replacement, each with both arms' runs, refits
GRPO's curve on the resampled GRPO runs and recomputes the gap on the resampled KL-Cov runs (2000 resamples, seed 0;
percentile interval). Seven seeds make that interval somewhat narrower than it should be (about sqrt(6/7)).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from entropy_openrlhf.algorithms.entropy_law import EntropyLawFit, fit_entropy_law
from study.runs import ENTROPY_KEY, EVAL_ACC_KEY

RUNS = Path("study/runs")
SEEDS = tuple(range(1, 8))
EXPERIMENTS = {  # title: (GRPO's run prefix, KL-Cov's, whether version 0 is the base model's separate evaluation)
    "levels 1-3, 25 steps": ("grpo", "kl_cov", False),
    "exploration, levels 3-4, 50 steps": ("explore_grpo", "explore_kl_cov", True),
}
RESAMPLES = 2000
BOOTSTRAP_SEED = 0


class Points(NamedTuple):
    """One run's evaluations: the policy version evaluated, the entropy of its row and the accuracy, by version."""

    version: np.ndarray
    entropy: np.ndarray
    acc: np.ndarray


def read_points(folder: Path, acc_key: str, base: dict[str, float] | None = None) -> Points:
    """A run's (version, entropy, accuracy) at each evaluation; with `base` (the base model's metrics), version 0
    is the base's accuracy beside the run's step-0 entropy."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    found = {}
    for r in rows:
        if acc_key in r and ENTROPY_KEY in r:
            found[int(r.get("eval/policy_version", r["step"]))] = (float(r[ENTROPY_KEY]), float(r[acc_key]))
    if base is not None:
        first = next((r for r in rows if r.get("step") == 0 and ENTROPY_KEY in r), None)
        if first is None or acc_key not in base:
            raise ValueError(f"{folder}: no step-0 entropy, or the base model's evaluation has no {acc_key}")
        found[0] = (float(first[ENTROPY_KEY]), float(base[acc_key]))
    if not found:
        raise ValueError(f"{folder}: no row holds both {ENTROPY_KEY} and {acc_key}")
    versions = sorted(found)
    return Points(np.array(versions), *(np.array([found[v][i] for v in versions]) for i in (0, 1)))


def pool(runs: list[Points]) -> Points:
    return Points(*(np.concatenate(columns) for columns in zip(*runs)))


def fit(runs: list[Points]) -> EntropyLawFit:
    p = pool(runs)
    return fit_entropy_law(p.entropy, p.acc)


def gap(curve: EntropyLawFit, runs: list[Points], final_only: bool = False) -> float:
    """Mean of acc - curve(entropy) over the runs' trained points (version > 0; with final_only, each run's last)."""
    if final_only:
        residuals = [r.acc[-1] - curve.predict(r.entropy[-1]) for r in runs]
    else:
        p = pool(runs)
        keep = p.version > 0
        residuals = p.acc[keep] - curve.predict(p.entropy[keep])
    return float(np.mean(residuals))


class Interval(NamedTuple):
    value: float
    low: float | None
    high: float | None


class CurveResult(NamedTuple):
    fits: dict[str, tuple[EntropyLawFit, Interval, Interval, Interval]]  # arm: fit, and a, b, b - a intervals
    gap_all: Interval
    gap_final: Interval
    grpo_own: float  # GRPO's mean residual on its own trained points
    finals: dict[str, tuple[float, float]]  # arm: mean final entropy, mean final accuracy
    resamples: int  # bootstrap resamples that could be fitted


def _interval(value: float, draws: list[float]) -> Interval:
    if not draws:
        return Interval(value, None, None)
    low, high = np.percentile(draws, [2.5, 97.5])
    return Interval(value, float(low), float(high))


def analyse(grpo: dict[int, Points], kl_cov: dict[int, Points], resamples: int = RESAMPLES,
            seed: int = BOOTSTRAP_SEED) -> CurveResult:  # fmt: skip
    """The fits, the gap and their paired-seed bootstrap intervals ({seed: a run's points} per arm, same seeds)."""
    seeds = sorted(grpo)
    if sorted(kl_cov) != seeds:
        raise ValueError(f"the arms' seeds differ: {seeds} and {sorted(kl_cov)}")
    arms = {"grpo": grpo, "kl_cov": kl_cov}
    fits = {arm: fit([runs[s] for s in seeds]) for arm, runs in arms.items()}
    curve = fits["grpo"]
    kl_runs = [kl_cov[s] for s in seeds]
    draws: dict[str, list[float]] = {name: [] for name in ("gap_all", "gap_final")}
    for arm in arms:
        draws.update({f"{arm}_a": [], f"{arm}_b": [], f"{arm}_ceiling": []})
    rng = np.random.default_rng(seed)
    done = 0
    for _ in range(resamples):
        picked = [seeds[i] for i in rng.integers(0, len(seeds), size=len(seeds))]
        try:
            refit = {arm: fit([runs[s] for s in picked]) for arm, runs in arms.items()}
        except ValueError:  # every picked run at one entropy: a and b cannot be separated
            continue
        done += 1
        for arm, f in refit.items():
            draws[f"{arm}_a"].append(f.a), draws[f"{arm}_b"].append(f.b), draws[f"{arm}_ceiling"].append(f.ceiling)
        picked_kl = [kl_cov[s] for s in picked]
        draws["gap_all"].append(gap(refit["grpo"], picked_kl))
        draws["gap_final"].append(gap(refit["grpo"], picked_kl, final_only=True))
    intervals = {
        arm: (f, _interval(f.a, draws[f"{arm}_a"]), _interval(f.b, draws[f"{arm}_b"]),
              _interval(f.ceiling, draws[f"{arm}_ceiling"]))
        for arm, f in fits.items()
    }  # fmt: skip
    finals = {
        arm: (float(np.mean([runs[s].entropy[-1] for s in seeds])), float(np.mean([runs[s].acc[-1] for s in seeds])))
        for arm, runs in arms.items()
    }
    return CurveResult(
        intervals,
        _interval(gap(curve, kl_runs), draws["gap_all"]),
        _interval(gap(curve, kl_runs, final_only=True), draws["gap_final"]),
        gap(curve, [grpo[s] for s in seeds]),
        finals,
        done,
    )


def fmt_interval(i: Interval, spec: str = "+.3f") -> str:
    if i.low is None:
        return f"{i.value:{spec}}"
    return f"{i.value:{spec}} [{i.low:{spec}}, {i.high:{spec}}]"


def report(title: str, r: CurveResult, acc_key: str) -> str:
    lines = [f"{title}: R = -a exp(H) + b, R = {acc_key}, H = {ENTROPY_KEY}; 95% paired-seed bootstrap intervals "
             f"({r.resamples} resamples). Exploratory."]  # fmt: skip
    for arm, (f, a, b, ceiling) in r.fits.items():
        lines.append(f"  {arm}: a {fmt_interval(a, '+.3f')}, b {fmt_interval(b, '.3f')}, ceiling b - a "
                     f"{fmt_interval(ceiling, '.3f')}, RMSE {f.rmse:.3f}, {f.n_points} points")  # fmt: skip
    lines += [
        f"  KL-Cov's accuracy minus GRPO's curve at its entropy: trained points {fmt_interval(r.gap_all)}, final "
        f"weights {fmt_interval(r.gap_final)} (GRPO's own trained points: {r.grpo_own:+.3f})",
        "  final weights, mean over the seeds: "
        + ", ".join(f"{arm} entropy {h:.3f}, accuracy {acc:.3f}" for arm, (h, acc) in r.finals.items()),
    ]
    return "\n".join(lines)


def load(runs_dir: Path, acc_key: str) -> dict[str, tuple[dict[int, Points], dict[int, Points]]]:
    base_path = runs_dir / "explore_base" / "metrics.json"
    out = {}
    for title, (grpo, kl, with_base) in EXPERIMENTS.items():
        base = json.loads(base_path.read_text()) if with_base else None
        out[title] = tuple(
            {s: read_points(runs_dir / f"{arm}_seed{s}", acc_key, base) for s in SEEDS} for arm in (grpo, kl)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=str(RUNS), help="the folder holding the committed runs")
    p.add_argument("--acc", default=EVAL_ACC_KEY, help="the accuracy of each evaluation (R)")
    args = p.parse_args(argv)
    try:
        for title, (grpo, kl) in load(Path(args.runs), args.acc).items():
            print(report(title, analyse(grpo, kl), args.acc) + "\n")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
