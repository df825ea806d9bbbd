"""The exploration experiment's analysis, exactly as fixed before its runs (study/notebook.md, "The exploration
experiment, fixed in advance"): GRPO and KL-Cov paired by seed, every run evaluated on one shared held-out set with
64 samples per prompt, and the base model evaluated once on the same set.

    python -m study.explore                       # study/runs/explore_{grpo,kl_cov}_seed<N>, explore_base
    python -m study.explore --runs other/runs --base other/runs/explore_base/metrics.json
    python -m study.explore --figure study/figures/explore_pass_at_k.png   # also draw pass@k against k

Printed:
- the primary endpoint: pass@32 of the final weights, KL-Cov minus GRPO over the seed pairs, with its t-interval,
  the t-test's p and the exact sign test's p;
- the five secondary endpoints as one Holm family: each arm's pass@32 minus the base model's (one number, so a
  one-sample t over that arm's runs), the paired differences in pass@1 and pass@64, and the paired log ratio of
  entropy over the last ten steps;
- each arm's pass@1, pass@32 and pass@64 of the final weights and of the midway ones (step 25), described and not
  tested;
- every pair's numbers, seed by seed;
- a check that no run had a step at which its code could have evaluated the wrong weights (study/notebook.md).

The figure (`--figure`) is descriptive, not part of the fixed analysis: pass@k against k for the base model and for
each arm's final and midway weights (mean over the paired seeds, 95% t-interval bars).

The evaluations are chosen by the weights they evaluated (`eval/policy_version` 50 and 25), and a run without its
final evaluation, or without one entropy row at each of its 50 steps, is an error. Only seeds 1-7 are analysed. With
fewer than seven pairs it prints only under `--interim`, and then says so on its first line: the design reports
nothing until all seven pairs are in.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from study.figures import plot_explore
from study.inference import fmt_p
from study.runs import ENTROPY_KEY, Run
from study.stats import Estimate, holm, mean_interval, sign_test_p, t_test_p

ARMS = ("explore_grpo", "explore_kl_cov")  # the baseline first: differences are the second minus the first
SEEDS = tuple(range(1, 8))  # the design's seven pairs
PAIRS_PLANNED = len(SEEDS)
PLANNED_SD = 0.08  # the spread of the paired pass@32 differences the stated power was computed for
STEPS = 50  # each run's training steps: its final weights are policy version 50
MIDWAY = 25  # the policy version evaluated midway
PRIMARY_K = 32
SECONDARY_KS = (1, 64)
LAST = 10  # entropy is averaged over the last ten steps
# The batches generated around the midway evaluation. With staleness 1 the evaluation of version 25 follows the
# generation of batch 26, beside training step 25, whose sync of version 26 could overtake it; or that of batch 25,
# when version 25 arrived before it (always in a run resumed from its step-25 checkpoint), and then no sync can
# overtake it, since training step 25 waits for batch 25, queued after the evaluation. One step of margin either
# side. The final evaluation runs on the trainer's thread after the producer has ended: no race there.
RISK_STEPS = range(MIDWAY - 1, MIDWAY + 3)
# Added to a batch's `time/rollout`: scoring it, its reference log-probs where logged, and `time/sync`, which under
# the collective sync these runs use holds the trainer's broadcast after the step (the producer's own sync takes no
# time there): it is not the producer's, and is added only as margin.
PRODUCER_TIMES = ("time/sync", "time/reward", "time/reference")
SEED_DIR = re.compile(r"(explore_\w+?)_seed(\d+)")
Curve = list[tuple[int, Estimate]]  # (k, pass@k over the seeds), k ascending


class Test(NamedTuple):
    """One endpoint: its name, the differences it is computed from, the estimate and the two p-values."""

    name: str
    differences: np.ndarray
    estimate: Estimate
    t_p: float | None
    sign_p: float | None


def test(name: str, differences: list[float], bounds: tuple[float, float]) -> Test:
    d = np.asarray(differences, dtype=float)
    return Test(name, d, mean_interval(d, bounds), t_test_p(d), sign_test_p(d))


def evaluations(run: Run, k: int) -> dict[int, float]:
    """{policy version evaluated: eval/pass@k} of every evaluation of the run (empty when it logged none). Chosen by
    the weights' version, not the row's position: a run whose final weights were not evaluated must not have its
    step-25 evaluation taken for them."""
    try:
        versions, values = run.pairs("eval/policy_version", f"eval/pass@{k}")
    except ValueError:
        return {}
    return {int(v): float(x) for v, x in zip(versions, values)}


def final_and_midway(run: Run, k: int) -> tuple[float, float | None]:
    """pass@k of the run's final weights (policy version 50) and of its midway ones (25; None when not evaluated)."""
    found = evaluations(run, k)
    if STEPS not in found:
        raise ValueError(
            f"{run.source}: no eval/pass@{k} of the final weights (eval/policy_version {STEPS}); evaluated: "
            f"{sorted(found) or 'none'}"
        )
    return found[STEPS], found.get(MIDWAY)


def final_entropy(run: Run) -> float:
    """entropy/seq_mean over the last ten of the run's 50 training steps."""
    s = run.series(ENTROPY_KEY)
    if s is None:
        raise ValueError(f"{run.source}: no {ENTROPY_KEY} logged")
    if sorted(int(x) for x in s[0]) != list(range(STEPS)):  # each step once: a resumed run repeats no row
        raise ValueError(f"{run.source}: {ENTROPY_KEY} is not logged once at each step 0..{STEPS - 1}")
    return float(np.mean(s[1][-LAST:]))


def steps_at_risk(run: Run) -> list[int] | None:
    """The steps at which the code the runs used (7d6c542) could have evaluated the next version under this one's
    label (study/notebook.md, amended before the analysis): among the batches generated around the midway
    evaluation (steps RISK_STEPS), those whose generation and scoring (`time/rollout` + `time/reward`, and
    `time/reference` where logged), plus `time/sync` as margin, took longer than either training step that could
    have run beside them (`time/train` of the same step or the one before). A step of the window without these
    timings counts as at risk. None when the run logged no timings at all."""
    try:
        rollout = dict(zip(*run.pairs("step", "time/rollout")))
        train = dict(zip(*run.pairs("step", "time/train")))
    except ValueError:
        return None
    logged = [run.series(key) for key in PRODUCER_TIMES]
    producer_side = [dict(zip(*series)) for series in logged if series is not None]
    at_risk = []
    for s in RISK_STEPS:
        beside = [train[t] for t in (s - 1, s) if t in train]
        if s not in rollout or not beside:  # a step without its timings cannot be cleared
            at_risk.append(s)
            continue
        generating = rollout[s] + sum(times.get(s, 0.0) for times in producer_side)
        if generating > min(beside):
            at_risk.append(s)
    return at_risk


def race_check(pairs: dict[int, dict[str, Run]]) -> str:
    """One line: whether any run had a step at risk of the evaluation-version race (steps_at_risk)."""
    found = {f"{arm}_seed{seed}": steps_at_risk(run) for seed, arms in pairs.items() for arm, run in arms.items()}
    unchecked = sorted(name for name, steps in found.items() if steps is None)
    risky = {name: steps for name, steps in found.items() if steps}
    if risky:
        return f"Evaluation-version check: steps at risk in {risky}"
    if unchecked:
        return f"Evaluation-version check: no step at risk; no timings logged in {unchecked}"
    return f"Evaluation-version check: no step at risk in any of the {len(found)} runs"


def find_pairs(runs_dir: Path) -> dict[int, dict[str, Run]]:
    """{seed: {arm: run}} for every seed that both arms have a metrics.jsonl for, seeds ascending."""
    found: dict[int, dict[str, Run]] = {}
    for path in sorted(runs_dir.glob("explore_*_seed*/metrics.jsonl")):
        match = SEED_DIR.fullmatch(path.parent.name)
        if match and match.group(1) in ARMS:
            found.setdefault(int(match.group(2)), {})[match.group(1)] = Run(path.parent, seed=match.group(2))
    return {seed: arms for seed, arms in sorted(found.items()) if len(arms) == len(ARMS)}


def read_base(path: Path) -> dict[int, float]:
    """{k: the base model's eval/pass@k} from scripts/evaluate.py's --eval.output_json."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: the base model's evaluation is missing (study/reproduce.sh runs it first)")
    values = json.loads(path.read_text())
    return {int(m.group(1)): float(v) for name, v in values.items() if (m := re.fullmatch(r"eval/pass@(\d+)", name))}


class Described(NamedTuple):
    """One pass@k described, not tested: each arm's mean over the pairs and the paired difference, KL-Cov - GRPO."""

    name: str
    grpo: Estimate
    kl_cov: Estimate
    difference: Estimate


class Analysis(NamedTuple):
    seeds: list[int]
    primary: Test
    secondary: list[Test]
    holm_p: list[float]
    final: list[Described]  # the final weights' pass@1, @32, @64, each arm beside the other
    midway: list[Described]  # the same at step 25
    per_seed: list[dict[str, float]]


def analyse(pairs: dict[int, dict[str, Run]], base: dict[int, float]) -> Analysis:
    grpo, kl = ARMS
    missing = [k for k in (PRIMARY_K, *SECONDARY_KS) if k not in base]
    if missing:
        raise ValueError(f"the base model's evaluation has no pass@{missing[0]}")
    rows = []
    for seed, arms in pairs.items():
        row: dict[str, float] = {"seed": seed}
        for arm in ARMS:
            for k in (PRIMARY_K, *SECONDARY_KS):
                row[f"{arm}:final@{k}"], row[f"{arm}:mid@{k}"] = final_and_midway(arms[arm], k)
            row[f"{arm}:entropy"] = final_entropy(arms[arm])
        rows.append(row)

    def diff(key: str) -> list[float]:
        return [r[f"{kl}:{key}"] - r[f"{grpo}:{key}"] for r in rows]

    primary = test(f"pass@{PRIMARY_K}, KL-Cov - GRPO", diff(f"final@{PRIMARY_K}"), (-1.0, 1.0))
    secondary = [
        test(f"pass@{PRIMARY_K}, GRPO - base", [r[f"{grpo}:final@{PRIMARY_K}"] - base[PRIMARY_K] for r in rows],
             (-1.0, 1.0)),
        test(f"pass@{PRIMARY_K}, KL-Cov - base", [r[f"{kl}:final@{PRIMARY_K}"] - base[PRIMARY_K] for r in rows],
             (-1.0, 1.0)),
        *(test(f"pass@{k}, KL-Cov - GRPO", diff(f"final@{k}"), (-1.0, 1.0)) for k in SECONDARY_KS),
        test(f"ln(entropy KL-Cov / GRPO), last {LAST} steps",
             [math.log(r[f"{kl}:entropy"]) - math.log(r[f"{grpo}:entropy"]) for r in rows], (-math.inf, math.inf)),
    ]  # fmt: skip
    # a p-value is None only when no pair differs: such a test cannot reject, so it enters Holm's family at 1
    holm_p = holm([1.0 if t.t_p is None else t.t_p for t in secondary])
    return Analysis(list(pairs), primary, secondary, holm_p, described(rows, "final"), described(rows, "mid"), rows)


def described(rows: list[dict[str, float]], when: str) -> list[Described]:
    """pass@1, @32 and @64 of each arm's weights `when` ("final" or "mid") over the pairs, and KL-Cov - GRPO: a
    description beside the tests, testing nothing; a k is left out where some run has no such evaluation."""
    out = []
    for k in (1, PRIMARY_K, 64):
        values = [[r[f"{arm}:{when}@{k}"] for r in rows] for arm in ARMS]
        if all(v is not None for arm_values in values for v in arm_values):
            out.append(Described(
                f"pass@{k}", mean_interval(values[0], (0.0, 1.0)), mean_interval(values[1], (0.0, 1.0)),
                mean_interval(np.subtract(values[1], values[0]), (-1.0, 1.0)),
            ))  # fmt: skip
    return out


def pass_at_k_by_arm(pairs: dict[int, dict[str, Run]], ks: list[int]) -> dict[str, dict[str, Curve]]:
    """{arm: {"final" / "step 25": [(k, mean and 95% interval over the paired seeds)]}} for every k in `ks` that
    each run logged for those weights; a midway curve is left out where some run has no step-25 evaluation."""
    curves: dict[str, dict[str, Curve]] = {}
    for arm in ARMS:
        for when, version in (("final", STEPS), (f"step {MIDWAY}", MIDWAY)):
            points = []
            for k in ks:
                found = [evaluations(arms[arm], k) for arms in pairs.values()]
                if all(version in f for f in found):
                    points.append((k, mean_interval([f[version] for f in found], (0.0, 1.0))))
            if points:
                curves.setdefault(arm, {})[when] = points
    return curves


def fmt_estimate(e: Estimate, spec: str = "+.3f") -> str:
    """Mean [low, high], a bound cut to the quantity's range marked with the interval as computed."""
    if e.low is None:
        return f"{e.mean:{spec}} (one value, no interval)"
    cut = f" (cut; uncut {e.low_uncut:{spec}}, {e.high_uncut:{spec}})" if e.low_cut or e.high_cut else ""
    return f"{e.mean:{spec}} [{e.low:{spec}}, {e.high:{spec}}]{cut}"


def report(a: Analysis, base: dict[int, float]) -> list[str]:
    n = len(a.seeds)
    lines = []
    if n < PAIRS_PLANNED:
        lines.append(f"PRELIMINARY: {n} of the {PAIRS_PLANNED} planned pairs (seeds {a.seeds}); the design reports "
                     f"nothing until all {PAIRS_PLANNED} are in.")  # fmt: skip
    lines += [
        f"The exploration experiment: {n} seed pairs (seeds {', '.join(map(str, a.seeds))}); base model pass@1 "
        f"{base[1]:.3f}, pass@{PRIMARY_K} {base[PRIMARY_K]:.3f}, pass@64 {base[64]:.3f}",
        "",
        "Primary endpoint (final weights), mean [95% t-interval], t-test p, exact sign test p:",
        f"  {a.primary.name}: {fmt_estimate(a.primary.estimate)}  t p = {fmt_p(a.primary.t_p)}  "
        f"sign p = {fmt_p(a.primary.sign_p)}  ({int(np.sum(a.primary.differences > 0))} of {n} pairs above 0; "
        f"SD of the differences {np.std(a.primary.differences, ddof=1):.3f}, against the {PLANNED_SD} the power was "
        "computed for)",
        "",
        "Secondary endpoints, one Holm family of five:",
    ]
    for t, adjusted in zip(a.secondary, a.holm_p):
        lines.append(f"  {t.name}: {fmt_estimate(t.estimate)}  t p = {fmt_p(t.t_p)}  Holm p = {fmt_p(adjusted)}  "
                     f"sign p = {fmt_p(t.sign_p)}  ({int(np.sum(t.differences > 0))} of {n} above 0)")  # fmt: skip
    for title, rows in (("Final weights", a.final), (f"Midway (step {MIDWAY})", a.midway)):
        if rows:
            lines += ["", f"{title}, described, not tested: GRPO, KL-Cov, KL-Cov - GRPO"]
            for d in rows:
                lines.append(f"  {d.name}: {fmt_estimate(d.grpo, '.3f')}, {fmt_estimate(d.kl_cov, '.3f')}, "
                             f"{fmt_estimate(d.difference)}")  # fmt: skip
    grpo, kl = ARMS
    lines += ["", f"Per seed: pass@{PRIMARY_K} GRPO / KL-Cov (final), entropy GRPO / KL-Cov (last {LAST} steps)"]
    for r in a.per_seed:
        g32, k32 = r[f"{grpo}:final@{PRIMARY_K}"], r[f"{kl}:final@{PRIMARY_K}"]
        g_h, k_h = r[f"{grpo}:entropy"], r[f"{kl}:entropy"]
        lines.append(f"  seed {int(r['seed'])}: {g32:.3f} / {k32:.3f}   {g_h:.3f} / {k_h:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="study/runs", help="the folder holding explore_<arm>_seed<N>/metrics.jsonl")
    p.add_argument("--base", default="", help="the base model's metrics.json (default: <runs>/explore_base/...)")
    p.add_argument("--figure", default="", help="also write pass@k against k to this PNG (descriptive)")
    p.add_argument(
        "--interim", action="store_true", help="print the analysis with fewer than the seven pairs, marked preliminary"
    )
    args = p.parse_args(argv)
    runs = Path(args.runs)
    base_path = Path(args.base) if args.base else runs / "explore_base" / "metrics.json"
    try:
        base = read_base(base_path)
        pairs = find_pairs(runs)
        others = sorted(set(pairs) - set(SEEDS))
        if others:
            raise ValueError(f"{runs}: seed pair(s) {others} are not among the design's seeds {list(SEEDS)}")
        if len(pairs) < PAIRS_PLANNED and not args.interim:
            raise ValueError(
                f"{runs}: {len(pairs)} of the {PAIRS_PLANNED} pairs are in; the design reports nothing until all are "
                "(--interim prints a preliminary analysis)"
            )
        if len(pairs) < 2:
            raise ValueError(f"{runs}: {len(pairs)} complete seed pair(s) of {' and '.join(ARMS)}; the tests need two")
        print("\n".join(report(analyse(pairs, base), base)))
        print(race_check(pairs))
        if args.figure:
            curves = pass_at_k_by_arm(pairs, sorted(base))
            print(f"wrote {plot_explore(base, curves, len(pairs), Path(args.figure))}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
