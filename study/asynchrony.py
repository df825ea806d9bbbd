"""The asynchrony experiment's analysis, fixed before its runs (study/notebook.md, "KL-Cov under asynchrony, fixed in
advance"): GRPO and KL-Cov at the seven-seed study's settings under three schedules, paired by seed.

    python -m study.asynchrony                  # the analysis; an error naming the runs still missing
    python -m study.asynchrony --power          # the power calculation that set the number of pairs
    python -m study.asynchrony --runs other/runs --interim    # fewer pairs than planned, marked preliminary

The schedules and their runs (study/runs/<run>/metrics.jsonl):
- sync: `async_{grpo,kl_cov}_sync_seed<N>`, batch mode at `--async.max_staleness 0`;
- one_step: `{grpo,kl_cov}_seed<N>`, seeds 1-7, the committed seven-seed pairs as they are (batch mode, staleness 1);
- partial: `async_{grpo,kl_cov}_partial_seed<N>`, `--rollout.mode partial --async.max_staleness 2`.

Printed:
- primary, per schedule: KL-Cov minus GRPO in ln(entropy/seq_mean) over the last ten steps, paired by seed, with its
  95% t-interval, the t-test's p and the exact sign test's p;
- the test that matters: the interaction, partial minus sync of each seed's effect, paired by seed, two-sided
  95% t-interval and p, and what it shows: "smaller under partial rollouts" only if the interval lies below 0;
- described, not tested: the interactions against the one-step-off pairs (seeds 1-7), which ran from older commits;
- secondary, one Holm family of five: KL-Cov minus GRPO in train accuracy (reward/acc, last ten steps) in each
  schedule; in the KL-Cov partial runs, the share of KL-Cov's selected tokens that were stale (sampled one or more
  versions behind: the sum over v >= 1 of `cov/staleness_<v>/selected_share`) minus the stale tokens' share of all
  tokens (the sum of `offpolicy/staleness_<v>/token_frac`), per step, averaged over the run's steps, one-sample t
  over the seeds; and ln(samples/s) of partial minus sync, each seed's two arms averaged, one-sample t;
- described: each schedule's entropy, train accuracy and samples/s per arm, the partial runs' token ages, and every
  seed's numbers.

A run's samples/s is the responses it trained on over steps 1-24 divided by the sum of their `time/step` (each step's
count is `throughput/samples_per_s` x `time/step`); step 0 holds the start-up. A run must log its entropy once at each
of its 25 steps, and its logs must match its schedule: no step above the schedule's staleness bound, every step of a
synchronous run at staleness 0, every step of a partial run with the streamed batch's token ages
(`async/token_staleness_mean`); otherwise it is an error naming the run.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from scipy import optimize

from study.explore import Test, fmt_estimate, test
from study.inference import fmt_p
from study.runs import ENTROPY_KEY, TRAIN_ACC_KEY, Run
from study.stats import holm, mean_interval, paired_t_power, pairs_for_power, t95

ARMS = ("grpo", "kl_cov")  # the baseline first: effects are KL-Cov minus GRPO
SCHEDULES = ("sync", "one_step", "partial")
TITLES = {"sync": "synchronous", "one_step": "one step off", "partial": "partial rollouts"}
MAX_STALENESS = {"sync": 0, "one_step": 1, "partial": 2}
ONE_STEP_SEEDS = tuple(range(1, 8))  # the committed seven pairs, reused as they are
CONFIRMATORY_SEEDS = (4, 5, 6, 7)  # run after the log ratio was chosen on seeds 1-3 (notebook, "Corrections", item 2)
STEPS = 25
LAST = 10
THROUGHPUT_FROM = 1  # samples/s over steps 1-24: step 0 holds the start-up

# The power calculation (--power), fixed before the runs: a two-sided paired t-test at 0.05 with 80% power to detect
# the effect halving under partial rollouts against synchronous training
ALPHA = 0.05
POWER = 0.8
MIN_PAIRS = 5
PLAN_RHO = 0.0  # a seed's effect under one schedule against its effect under another: not estimable, assumed 0
PAIRS_PLANNED = 27  # what plan() gives from the committed seven pairs (a test checks it)
NEW_SEEDS = tuple(range(1, PAIRS_PLANNED + 1))

STALENESS_MAX_KEY = "async/staleness_max"
TOKEN_STALENESS_KEY = "async/token_staleness_mean"
STEP_TIME_KEY = "time/step"
THROUGHPUT_KEY = "throughput/samples_per_s"
SELECTED_SHARE = re.compile(r"cov/staleness_(\d+)/selected_share")
TOKEN_FRAC = re.compile(r"offpolicy/staleness_(\d+)/token_frac")
DESCRIBED_PARTIAL = (TOKEN_STALENESS_KEY, "rollout/partial_frac", "rollout/stale_kv_token_frac")
DROPPED_KEY = "rollout/dropped_stale_groups"  # a running count: its last value is the run's total


def run_name(arm: str, schedule: str, seed: int) -> str:
    """The folder under study/runs of one run of the experiment."""
    return f"{arm}_seed{seed}" if schedule == "one_step" else f"async_{arm}_{schedule}_seed{seed}"


def design_seeds(schedule: str) -> tuple[int, ...]:
    return ONE_STEP_SEEDS if schedule == "one_step" else NEW_SEEDS


# ------------------------------------------------------------------------------------------- one run's numbers


class RunValues(NamedTuple):
    entropy: float  # entropy/seq_mean over the last ten steps
    train_acc: float  # reward/acc over the last ten steps
    samples_per_s: float
    stale_excess: float | None  # KL-Cov under partial rollouts: stale share of the selection minus of all tokens
    by_age: dict[int, tuple[float, float]]  # {v: (mean selected share, mean token share)} over the run's steps
    described: dict[str, float]  # partial runs: the token-age metrics averaged over the steps, dropped groups


def per_step(run: Run, key: str) -> dict[int, float]:
    """{step: value} of a metric the run logs once per training step; ValueError when it logged none."""
    found = run.series(key)
    if found is None:
        raise ValueError(f"{run.source}: no {key} logged")
    steps, values = found
    out = {int(s): float(v) for s, v in zip(steps, values)}
    if len(out) != len(steps):
        raise ValueError(f"{run.source}: {key} is logged twice at some step")
    return out


def last_mean(values: dict[int, float]) -> float:
    return float(np.mean([values[s] for s in sorted(values)[-LAST:]]))


def check_schedule(run: Run, schedule: str) -> None:
    """The run's logs match its schedule and the design: each of the 25 steps logged once, no step above the
    schedule's staleness bound, a synchronous run at staleness 0 throughout, a partial run streamed (token ages
    logged at every step)."""
    entropy = per_step(run, ENTROPY_KEY)
    if sorted(entropy) != list(range(STEPS)):
        raise ValueError(f"{run.source}: {ENTROPY_KEY} is not logged once at each step 0..{STEPS - 1}")
    staleness = per_step(run, STALENESS_MAX_KEY)
    bound = MAX_STALENESS[schedule]
    over = sorted(s for s, v in staleness.items() if v > bound)
    if over:
        raise ValueError(f"{run.source}: staleness above {bound} (the {TITLES[schedule]} schedule's) at steps {over}")
    if schedule == "sync" and sorted(staleness) != list(range(STEPS)):
        raise ValueError(f"{run.source}: a synchronous run must log {STALENESS_MAX_KEY} 0 at every step")
    if schedule == "partial":
        try:
            streamed = per_step(run, TOKEN_STALENESS_KEY)
        except ValueError:
            streamed = {}
        if sorted(streamed) != list(range(STEPS)):
            raise ValueError(
                f"{run.source}: not a streamed run ({TOKEN_STALENESS_KEY} not logged at every step), but named as "
                "one of partial rollouts"
            )


def samples_per_s(run: Run) -> float:
    """Responses trained on over steps 1-24 per second of their summed `time/step`."""
    times, rates = per_step(run, STEP_TIME_KEY), per_step(run, THROUGHPUT_KEY)
    steps = range(THROUGHPUT_FROM, STEPS)
    missing = [s for s in steps if s not in times or s not in rates]
    if missing:
        raise ValueError(f"{run.source}: no {STEP_TIME_KEY} or {THROUGHPUT_KEY} at steps {missing}")
    return sum(rates[s] * times[s] for s in steps) / sum(times[s] for s in steps)


def selection_by_age(run: Run) -> tuple[float, dict[int, tuple[float, float]]]:
    """KL-Cov's selection against the tokens by age: (the run's mean over steps of the stale share of the selected
    tokens minus the stale share of all tokens, {v: (mean selected share, mean token share)}). Stale: sampled one or
    more versions behind the trainer. Steps where nothing was selected (no selected_share logged) are left out; an
    age a step does not log counts 0 there."""
    names = run.metric_names()
    selected = {int(m.group(1)): per_step(run, n) for n in names if (m := SELECTED_SHARE.fullmatch(n))}
    shares = {int(m.group(1)): per_step(run, n) for n in names if (m := TOKEN_FRAC.fullmatch(n))}
    steps = sorted({s for values in selected.values() for s in values})
    if not steps:
        raise ValueError(f"{run.source}: no cov/staleness_<v>/selected_share logged: where KL-Cov's selection fell")
    ages = sorted(set(selected) | set(shares))
    excess = [
        sum(selected.get(v, {}).get(s, 0.0) - shares.get(v, {}).get(s, 0.0) for v in ages if v >= 1) for s in steps
    ]
    by_age = {
        v: (
            float(np.mean([selected.get(v, {}).get(s, 0.0) for s in steps])),
            float(np.mean([shares.get(v, {}).get(s, 0.0) for s in steps])),
        )
        for v in ages
    }
    return float(np.mean(excess)), by_age


def run_values(run: Run, arm: str, schedule: str) -> RunValues:
    check_schedule(run, schedule)
    excess, by_age, described = None, {}, {}
    if schedule == "partial":
        for key in DESCRIBED_PARTIAL:
            found = run.series(key)
            if found is not None:
                described[key] = float(np.mean(found[1]))
        dropped = run.series(DROPPED_KEY)
        described[DROPPED_KEY] = float(dropped[1][-1]) if dropped is not None else 0.0
        if arm == "kl_cov":
            excess, by_age = selection_by_age(run)
    return RunValues(
        last_mean(per_step(run, ENTROPY_KEY)),
        last_mean(per_step(run, TRAIN_ACC_KEY)),
        samples_per_s(run),
        excess,
        by_age,
        described,
    )


# ------------------------------------------------------------------------------------------ finding the runs

Values = dict[str, dict[str, dict[int, RunValues]]]  # {schedule: {arm: {seed: values}}}


def ranges(seeds: Sequence[int]) -> str:
    """1-5, 7, 9-10."""
    parts, seeds = [], sorted(seeds)
    start = prev = seeds[0]
    for s in [*seeds[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(parts)


def missing_runs(runs_dir: Path, seeds: dict[str, Sequence[int]]) -> list[str]:
    """The runs of the design not in runs_dir, one entry per arm and schedule: `async_grpo_sync_seed{1-27}`."""
    out = []
    for schedule in SCHEDULES:
        for arm in ARMS:
            absent = [
                s for s in seeds[schedule] if not (runs_dir / run_name(arm, schedule, s) / "metrics.jsonl").exists()
            ]
            if absent:
                out.append(f"{run_name(arm, schedule, 0).removesuffix('0')}{{{ranges(absent)}}}")
    return out


def extra_seeds(runs_dir: Path) -> list[str]:
    """Runs of the new schedules whose seed is outside the design's."""
    found = []
    for path in sorted(runs_dir.glob("async_*_seed*/metrics.jsonl")):
        match = re.fullmatch(r"async_(grpo|kl_cov)_(sync|partial)_seed(\d+)", path.parent.name)
        if match and int(match.group(3)) not in NEW_SEEDS:
            found.append(path.parent.name)
    return found


def complete_seeds(runs_dir: Path) -> list[int]:
    """The design's seeds with all four new runs in (both arms, both new schedules)."""
    return [
        s
        for s in NEW_SEEDS
        if all(
            (runs_dir / run_name(arm, schedule, s) / "metrics.jsonl").exists()
            for arm in ARMS
            for schedule in ("sync", "partial")
        )
    ]


def read_values(runs_dir: Path, seeds: dict[str, Sequence[int]]) -> Values:
    return {
        schedule: {
            arm: {
                s: run_values(Run(runs_dir / run_name(arm, schedule, s), seed=f"seed{s}"), arm, schedule)
                for s in seeds[schedule]
            }
            for arm in ARMS
        }
        for schedule in SCHEDULES
    }


# ------------------------------------------------------------------------------------------------ the analysis


class Analysis(NamedTuple):
    seeds: dict[str, list[int]]
    primary: dict[str, Test]  # per schedule: ln(H_kl_cov) - ln(H_grpo), paired by seed
    interaction: Test  # partial minus sync of the per-seed effects
    planned: float  # the interaction the design was powered for (minus half the confirmatory effect)
    interaction_power: float | None  # the test's power at that interaction, with the observed spread
    described_interactions: list[Test]  # against the one-step-off pairs, not tested
    secondary: list[Test]
    holm_p: list[float]
    values: Values


def effects(values: Values, schedule: str, seeds: Sequence[int]) -> dict[int, float]:
    """{seed: ln(H_kl_cov / H_grpo)} over the last ten steps."""
    arms = values[schedule]
    return {s: math.log(arms["kl_cov"][s].entropy) - math.log(arms["grpo"][s].entropy) for s in seeds}


def planned_interaction(runs_dir: Path) -> float:
    """The interaction the design was powered for: minus half the confirmatory one-step-off effect."""
    return -plan(committed_effects(runs_dir)).effect / 2


def analyse(values: Values, planned: float) -> Analysis:
    seeds = {schedule: sorted(values[schedule]["grpo"]) for schedule in SCHEDULES}
    e = {schedule: effects(values, schedule, seeds[schedule]) for schedule in SCHEDULES}
    primary = {
        schedule: test(f"ln(H_kl_cov / H_grpo), {TITLES[schedule]}", list(e[schedule].values()), (-math.inf, math.inf))
        for schedule in SCHEDULES
    }
    both = [s for s in seeds["partial"] if s in e["sync"]]
    interaction = test(
        "interaction: partial minus sync", [e["partial"][s] - e["sync"][s] for s in both], (-math.inf, math.inf)
    )
    d = interaction.differences
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    power = paired_t_power(planned, sd, int(d.size), ALPHA)

    described = []
    for later, earlier in (("one_step", "sync"), ("partial", "one_step")):
        common = [s for s in seeds[later] if s in e[earlier]]
        if len(common) >= 2:
            described.append(
                test(
                    f"{TITLES[later]} minus {TITLES[earlier]} (seeds {ranges(common)})",
                    [e[later][s] - e[earlier][s] for s in common],
                    (-math.inf, math.inf),
                )
            )

    secondary = []
    for schedule in SCHEDULES:
        arms = values[schedule]
        secondary.append(
            test(
                f"train acc KL-Cov - GRPO, {TITLES[schedule]}",
                [arms["kl_cov"][s].train_acc - arms["grpo"][s].train_acc for s in seeds[schedule]],
                (-1.0, 1.0),
            )
        )
    kl_partial = values["partial"]["kl_cov"]
    secondary.append(
        test(
            "KL-Cov's selection, stale share minus all tokens' stale share, partial",
            [kl_partial[s].stale_excess for s in seeds["partial"]],
            (-1.0, 1.0),
        )
    )
    secondary.append(
        test(
            "ln(samples/s) partial - sync, both arms averaged",
            [
                float(
                    np.mean(
                        [
                            math.log(values["partial"][arm][s].samples_per_s)
                            - math.log(values["sync"][arm][s].samples_per_s)
                            for arm in ARMS
                        ]
                    )
                )
                for s in both
            ],
            (-math.inf, math.inf),
        )
    )
    # a p-value is None only when no seed differs: such a test cannot reject, so it enters the family at 1
    holm_p = holm([1.0 if t.t_p is None else t.t_p for t in secondary])
    return Analysis(seeds, primary, interaction, planned, power, described, secondary, holm_p, values)


def verdict(t: Test) -> str:
    """What the interaction shows, in the words fixed in advance."""
    e = t.estimate
    if e.high is not None and e.high < 0:
        return "KL-Cov's entropy effect is smaller under partial rollouts than under synchronous training"
    if e.low is not None and e.low > 0:
        return "KL-Cov's entropy effect is larger under partial rollouts than under synchronous training"
    return "a difference between the two schedules' effects is not shown in either direction"


def fmt_test(t: Test, n: int) -> str:
    return (
        f"{fmt_estimate(t.estimate)}  t p = {fmt_p(t.t_p)}  sign p = {fmt_p(t.sign_p)}  "
        f"({int(np.sum(t.differences > 0))} of {n} above 0)"
    )


def report(a: Analysis, interim: bool = False) -> list[str]:
    lines = []
    n_new = len(a.seeds["partial"])
    if interim:
        lines.append(
            f"PRELIMINARY: {n_new} of the {PAIRS_PLANNED} planned pairs per new schedule (seeds "
            f"{ranges(a.seeds['partial'])}); the design reports nothing until all are in."
        )
    lines += [
        "KL-Cov under asynchrony: GRPO and KL-Cov paired by seed, levels 1-3, 4 x 4, 25 steps; "
        + "; ".join(f"{TITLES[s]} seeds {ranges(a.seeds[s])}" for s in SCHEDULES),
        "",
        f"Primary, per schedule: ln(H_kl_cov / H_grpo), entropy over the last {LAST} steps, mean [95% t]:",
    ]
    for schedule in SCHEDULES:
        t = a.primary[schedule]
        lines.append(
            f"  {TITLES[schedule]}: {fmt_test(t, len(a.seeds[schedule]))}  ratio {math.exp(t.estimate.mean):.2f}x"
        )
    t = a.interaction
    power = "n/a" if a.interaction_power is None else f"{a.interaction_power:.2f}"
    lines += [
        "",
        "The test that matters, two-sided: partial minus sync of each seed's effect, mean [95% t]:",
        f"  {fmt_test(t, t.differences.size)}  ratio of the effects {math.exp(t.estimate.mean):.2f}x",
        f"  SD of the differences {np.std(t.differences, ddof=1):.3f}; power at the planned interaction "
        f"{a.planned:+.3f} with this spread: {power}",
        f"  {verdict(t)}",
        "",
        "Described, not tested (the one-step-off pairs ran from older commits): difference of the effects",
    ]
    for d in a.described_interactions:
        lines.append(f"  {d.name}: {fmt_estimate(d.estimate)}")
    lines += ["", f"Secondary, one Holm family of {len(a.secondary)}:"]
    for t, adjusted in zip(a.secondary, a.holm_p):
        lines.append(f"  {t.name}: {fmt_test(t, t.differences.size)}  Holm p = {fmt_p(adjusted)}")
    lines += ["", "Described, per schedule and arm, mean [95% t] over the seeds:"]
    for schedule in SCHEDULES:
        for arm in ARMS:
            runs = a.values[schedule][arm].values()
            lines.append(
                f"  {TITLES[schedule]}, {arm}: entropy {fmt_estimate(mean_interval([v.entropy for v in runs]), '.3f')}"
                f"  train acc {fmt_estimate(mean_interval([v.train_acc for v in runs], (0.0, 1.0)), '.3f')}"
                f"  samples/s {fmt_estimate(mean_interval([v.samples_per_s for v in runs]), '.3f')}"
            )
    lines += ["", "Partial rollouts, described: mean over the steps, then over the seeds"]
    for arm in ARMS:
        runs = list(a.values["partial"][arm].values())
        parts = [
            f"{key} {np.mean([v.described[key] for v in runs]):.3f}"
            for key in (*DESCRIBED_PARTIAL, DROPPED_KEY)
            if all(key in v.described for v in runs)
        ]
        lines.append(f"  {arm}: " + ", ".join(parts))
    kl = list(a.values["partial"]["kl_cov"].values())
    ages = sorted({v for r in kl for v in r.by_age})
    lines.append("  KL-Cov's selection by token age, selected share / all tokens' share: " + ", ".join(
        f"v = {v}: {np.mean([r.by_age.get(v, (0.0, 0.0))[0] for r in kl]):.3f} / "
        f"{np.mean([r.by_age.get(v, (0.0, 0.0))[1] for r in kl]):.3f}"
        for v in ages
    ))  # fmt: skip
    lines += ["", "Per seed: ln(H_kl_cov / H_grpo) sync / one step off / partial, partial minus sync"]
    e = {schedule: effects(a.values, schedule, a.seeds[schedule]) for schedule in SCHEDULES}
    for s in sorted(set().union(*(a.seeds[x] for x in SCHEDULES))):
        cells = [f"{e[x][s]:+.3f}" if s in e[x] else "-" for x in SCHEDULES]
        inter = f"{e['partial'][s] - e['sync'][s]:+.3f}" if s in e["partial"] and s in e["sync"] else "-"
        lines.append(f"  seed {s}: {' / '.join(cells)}, {inter}")
    return lines


# ------------------------------------------------------------------------------------------------------ power


class Plan(NamedTuple):
    """The planning values of the interaction test and the pairs they ask for."""

    effect: float  # delta: KL-Cov's effect, ln(H_kl_cov / H_grpo), under synchronous training
    sd: float  # sigma: the SD of the per-seed effects within one schedule
    rho: float  # the correlation of a seed's effect under one schedule with its effect under the other
    pairs: int | None  # pairs per new schedule for POWER at ALPHA, at least MIN_PAIRS; None if none reach it


def interaction_sd(sd: float, rho: float) -> float:
    """The SD of a seed's partial-minus-sync difference of effects, each with SD `sd`, correlated `rho`."""
    return sd * math.sqrt(2 * (1 - rho))


def interaction_power(effect: float, sd: float, rho: float, n: int, alpha: float = ALPHA) -> float | None:
    """Power of the two-sided paired t-test over n seeds of the interaction when the effect halves (-effect / 2)."""
    return paired_t_power(-effect / 2, interaction_sd(sd, rho), n, alpha)


def pairs_needed(effect: float, sd: float, rho: float, power: float = POWER) -> int | None:
    n = pairs_for_power(-effect / 2, interaction_sd(sd, rho), power, ALPHA)
    return None if n is None else max(MIN_PAIRS, n)


def detectable(sd: float, n: int, power: float = POWER) -> float:
    """The smallest |mean difference| the two-sided paired t-test over n pairs with this SD detects with `power`."""
    return float(optimize.brentq(lambda m: paired_t_power(m, sd, n, ALPHA) - power, 1e-9 * sd, 100 * sd))


def committed_effects(runs_dir: Path) -> dict[int, float]:
    """{seed: ln(H_kl_cov / H_grpo) over the last ten steps} of the committed one-step-off pairs, seeds 1-7."""
    missing = missing_runs(runs_dir, {"sync": (), "one_step": ONE_STEP_SEEDS, "partial": ()})
    if missing:
        raise FileNotFoundError(f"{runs_dir}: the committed seven pairs are missing runs: {', '.join(missing)}")
    entropy = {
        arm: {s: last_mean(per_step(Run(runs_dir / run_name(arm, "one_step", s)), ENTROPY_KEY)) for s in ONE_STEP_SEEDS}
        for arm in ARMS
    }
    return {s: math.log(entropy["kl_cov"][s]) - math.log(entropy["grpo"][s]) for s in ONE_STEP_SEEDS}


def summary(effects: dict[int, float], seeds: Sequence[int]) -> tuple[float, float]:
    x = np.array([effects[s] for s in seeds])
    return float(x.mean()), float(x.std(ddof=1))


def plan(effects: dict[int, float]) -> Plan:
    """The planning values fixed in advance: delta the confirmatory seeds' mean (not used to choose the endpoint;
    the smaller estimate), sigma the SD over all seven pairs (the most degrees of freedom; the larger), rho 0."""
    effect, _ = summary(effects, CONFIRMATORY_SEEDS)
    _, sd = summary(effects, ONE_STEP_SEEDS)
    return Plan(effect, sd, PLAN_RHO, pairs_needed(effect, sd, PLAN_RHO))


def power_report(effects: dict[int, float]) -> list[str]:
    p = plan(effects)
    n = p.pairs or PAIRS_PLANNED
    s_int = interaction_sd(p.sd, p.rho)
    seven, confirm, later = (summary(effects, s) for s in (ONE_STEP_SEEDS, CONFIRMATORY_SEEDS, ONE_STEP_SEEDS[1:]))
    lines = [
        "Power of the asynchrony experiment, from the committed seven one-step-off pairs (grpo_seed1-7, "
        "kl_cov_seed1-7)",
        f"Per-seed ln(H_kl_cov / H_grpo), last {LAST} steps: "
        + ", ".join(f"seed {s} {effects[s]:+.3f}" for s in ONE_STEP_SEEDS),
        f"  seeds 1-7: mean {seven[0]:+.3f}, SD {seven[1]:.3f}; seeds 4-7 (confirmatory): mean {confirm[0]:+.3f}, "
        f"SD {confirm[1]:.3f}; seeds 2-7: mean {later[0]:+.3f}, SD {later[1]:.3f}",
        "",
        f"Planning values: delta = {p.effect:+.3f} (seeds 4-7), sigma = {p.sd:.3f} (seeds 1-7), rho = {p.rho:g}",
        f"The effect halving: an interaction of {-p.effect / 2:+.3f}; SD of a seed's difference "
        f"sigma sqrt(2 (1 - rho)) = {s_int:.3f}; two-sided paired t-test at {ALPHA:g}",
        f"Pairs per new schedule for {POWER:.0%} power: {p.pairs} (at least {MIN_PAIRS}); planned: {PAIRS_PLANNED}",
        "",
        f"At {n} pairs:",
        f"  the interaction test: power {interaction_power(p.effect, p.sd, p.rho, n):.2f} if the effect halves, "
        f"{paired_t_power(-p.effect / 4, s_int, n):.2f} if it loses a quarter, "
        f"{paired_t_power(-p.effect, s_int, n):.2f} if it vanishes; "
        f"{POWER:.0%} power for an interaction of {detectable(s_int, n):.3f} or more (either sign)",
        f"  one schedule's own effect (primary): power {paired_t_power(p.effect / 2, p.sd, n):.2f} to detect "
        f"delta / 2, {paired_t_power(p.effect, p.sd, n):.2f} delta; {POWER:.0%} for {detectable(p.sd, n):.3f} or more",
        f"  the 95% t-interval of the interaction: +-{t_half(s_int, n):.3f} at the planned spread",
        "",
        f"Sensitivity, pairs for {POWER:.0%} power (power at {n} pairs):",
        "  | delta | sigma | rho = 0 | rho = 0.5 |",
        "  |---|---|---|---|",
    ]
    for effect, e_name in ((confirm[0], "seeds 4-7"), (seven[0], "seeds 1-7")):
        for sd, s_name in ((seven[1], "seeds 1-7"), (later[1], "seeds 2-7"), (confirm[1], "seeds 4-7")):
            cells = [
                f"{pairs_needed(effect, sd, rho)} ({interaction_power(effect, sd, rho, n):.2f})" for rho in (0.0, 0.5)
            ]
            lines.append(f"  | {effect:+.3f} ({e_name}) | {sd:.3f} ({s_name}) | {cells[0]} | {cells[1]} |")
    return lines


def t_half(sd: float, n: int) -> float:
    """The half-width of a 95% t-interval over n values with this SD."""
    return t95(n - 1) * sd / math.sqrt(n)


# ------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="study/runs", help="the folder holding the runs (<run>/metrics.jsonl)")
    p.add_argument("--power", action="store_true", help="print the power calculation from the committed seven pairs")
    p.add_argument(
        "--interim", action="store_true", help="analyse the seeds whose four new runs are in, marked preliminary"
    )
    args = p.parse_args(argv)
    runs = Path(args.runs)
    try:
        if args.power:
            print("\n".join(power_report(committed_effects(runs))))
            return 0
        extra = extra_seeds(runs)
        if extra:
            raise ValueError(f"{runs}: runs outside the design's seeds {ranges(NEW_SEEDS)}: {', '.join(extra)}")
        seeds: dict[str, Sequence[int]] = {"sync": NEW_SEEDS, "one_step": ONE_STEP_SEEDS, "partial": NEW_SEEDS}
        if args.interim:
            done = complete_seeds(runs)
            if len(done) < 2:
                raise ValueError(f"{runs}: {len(done)} seed(s) with all four new runs in; the tests need two")
            seeds = {**seeds, "sync": done, "partial": done}
        missing = missing_runs(runs, seeds)
        if missing:
            raise FileNotFoundError(
                f"{runs}: the design's runs are not all in; missing: {', '.join(missing)}"
                + ("" if args.interim else " (--interim analyses the seeds whose four new runs are in)")
            )
        a = analyse(read_values(runs, seeds), planned_interaction(runs))
        print("\n".join(report(a, interim=args.interim)))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
