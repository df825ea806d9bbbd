"""Reading the runs, one method per label with one run per seed, and the per-run figures the tables and plots use."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from entropy_openrlhf.algorithms.entropy_law import EntropyLawFit, fit_entropy_law, read_csv, read_wandb_offline
from study.stats import Estimate, mean_interval

ENTROPY_KEY = "entropy/seq_mean"
TRAIN_ACC_KEY = "reward/acc"
EVAL_ACC_KEY = "eval/acc"
COV_KEY = "cov/mean"
KNOB_KEYS = ("entropy_ctl/scale", "entropy_ctl/bonus")  # what the entropy controller set, step by step
PASS_AT_K = re.compile(r"eval/pass@(\d+)")  # the average over sources; not eval/<source>/pass@k or the _ci95 bounds
BAND = "band"  # the seed values' name for the share of steps inside --band


@dataclass
class Run:
    """One training run (one seed): a CSV file, or a folder holding metrics.jsonl (a run's output folder,
    study/runs/<run>) or files/metrics.jsonl (a W&B offline folder, where runs before it moved kept it)."""

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


class MechanismPoints(NamedTuple):
    """One run's (or several runs' pooled) points of the mechanism check, one per step t."""

    cov: np.ndarray  # cov/mean at step t
    change: np.ndarray  # entropy[t + 1] - entropy[t]
    level: np.ndarray  # entropy[t]: a low entropy has less room to fall, whatever the covariance


def find_run(path: Path) -> Path:
    """The CSV or run folder that `path` names, or the single run folder below it: a folder holding metrics.jsonl,
    or a W&B offline folder holding files/metrics.jsonl (how runs before it moved to the output folder left it)."""
    if path.is_file():
        if path.suffix.lower() != ".csv":
            raise ValueError(f"{path}: expected a .csv file or a run folder")
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    if (path / "files" / "metrics.jsonl").exists() or (path / "metrics.jsonl").exists():
        return path
    found = sorted({p.parent.parent if p.parent.name == "files" else p.parent for p in path.glob("**/metrics.jsonl")})
    if len(found) != 1:
        what = "no run folder (metrics.jsonl)" if not found else f"{len(found)} run folders: {found}"
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
    # the last seed<N> in the path (outputs/repro/kl_cov_seed2) pairs seeds across methods;
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


def cov_entropy_points(run: Run) -> MechanismPoints:
    """(cov/mean[t], entropy[t+1] - entropy[t], entropy[t]) over the steps t that hold both, t + 1 logging entropy.

    Both are measured by the trainer with the weights it holds at the start of the step, so the entropy difference of
    consecutive steps is the effect of step t's update, whose covariance is cov/mean[t]."""
    cov, ent = run.series(COV_KEY), run.series(ENTROPY_KEY)
    if cov is None or ent is None:
        return MechanismPoints(np.array([]), np.array([]), np.array([]))
    h = dict(zip(ent[0].tolist(), ent[1].tolist()))
    steps = [(s, c) for s, c in zip(cov[0].tolist(), cov[1].tolist()) if s in h and s + 1 in h]
    cov_t = np.array([c for _, c in steps])
    return MechanismPoints(cov_t, np.array([h[s + 1] - h[s] for s, _ in steps]), np.array([h[s] for s, _ in steps]))


def pooled(points: list[MechanismPoints]) -> MechanismPoints:
    """Several runs' points as one set."""
    return MechanismPoints(*(np.concatenate(columns) for columns in zip(*points)))


def mechanism(methods: list[Method]) -> dict[str, list[MechanismPoints]]:
    """Each method's mechanism points, run by run (the run is the unit a bootstrap resamples); runs without points
    and methods without any are left out."""
    out = {}
    for m in methods:
        found = [p for p in (cov_entropy_points(run) for run in m.runs) if p.cov.size]
        if found:
            out[m.label] = found
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


def controller_moved(m: Method) -> bool:
    """Whether the entropy controller of some run of `m` moved a knob (scale off 1 or a bonus above 0)."""
    for run in m.runs:
        scale, bonus = run.series(KNOB_KEYS[0]), run.series(KNOB_KEYS[1])
        if (scale is not None and np.any(scale[1] != 1.0)) or (bonus is not None and np.any(bonus[1] > 0)):
            return True
    return False


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
