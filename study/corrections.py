"""Corrections to the study's write-up (study/notebook.md, "Corrections"), each printed from the committed runs:

    python -m study.corrections                    # every section below, in order
    python -m study.corrections --only base        # one section: mechanism, kl_cov, seeds, widths, base, chance,
                                                   # staleness

- mechanism: the covariance-entropy correlation (study/inference.py's mechanism table) on the 15 runs it was found
  on, on the 19 later 25-step runs it never saw, and on the 14 runs of the exploration experiment;
- kl_cov: KL-Cov's primary endpoint, the log entropy ratio over the last ten steps, over the seven seeds as fixed,
  beside seeds 4-7 alone (run after the endpoint was chosen on seeds 1-3: the confirmatory figure) and seeds 2-7;
- seeds: per task, the seeds in which KL-Cov's entropy ended below GRPO's (levels 1-3, 25 steps; levels 3-4, 50);
- widths: how wide the paired pass@k intervals are, per comparison (what "no difference" can and cannot exclude);
- base: the exploration experiment's "arm minus base" tests with the base model's own sampling error in them. Its
  evaluation logged only averages, so its per-prompt correct counts are reconstructed per level as the
  maximum-entropy distribution of counts that reproduces its seven logged pass@k exactly; the exact (ideal)
  bootstrap over prompts and samples of that distribution gives the base's standard error, which enters a Welch
  t-test beside the runs' spread. Then the Holm family of five again, with the two changed p-values;
- chance: the pass@k of a policy that answers every prompt of a level with a number drawn from that level's answer
  distribution (exact, from the task generator's test split), on the exploration experiment's held-out set;
- staleness: the runs whose log shows a step after the first trained at staleness 0 (`async/staleness_mean` 0),
  the mark of a run resumed from a checkpoint with the code of that time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from scipy import optimize
from scipy import stats as sps

from entropy_openrlhf.algorithms.metrics import pass_at_k
from entropy_openrlhf.data.arith_task import EXAMPLES, in_test_split
from study import explore
from study.inference import compare, fmt_p, mechanism_table
from study.runs import ENTROPY_KEY, Method, Run, mechanism, seed_values
from study.stats import Estimate, holm, mean_interval, sign_test_p, t95, t_test_p

RUNS = Path("study/runs")
SEVEN = range(1, 8)
# the mechanism was found on the three-seed study's 15 runs; the 19 later 25-step runs of the fixed-in-advance
# comparisons never entered it, nor did the exploration experiment's 14 (levels 3-4, 50 steps)
FIRST_RUNS = {arm: range(1, 4) for arm in ("grpo", "clip_cov", "clip_cov_wide", "kl_cov", "kl_cov_band")}
LATER_RUNS = {"grpo": range(4, 8), "clip_cov_wide": range(4, 8), "kl_cov": range(4, 8), "clip_cov_r03": SEVEN}
EXPLORE_RUNS = {"explore_grpo": SEVEN, "explore_kl_cov": SEVEN}
CHANCE_KS = (1, 32, 64)
STALENESS_KEY = "async/staleness_mean"


def methods_of(runs_dir: Path, arms: dict[str, Sequence[int]]) -> list[Method]:
    """One Method per arm, its runs study/runs/<arm>_seed<N> with their seed ids set; an error names a missing run."""
    out = []
    for arm, seeds in arms.items():
        runs = []
        for seed in seeds:
            folder = runs_dir / f"{arm}_seed{seed}"
            if not (folder / "metrics.jsonl").exists():
                raise FileNotFoundError(f"{folder}/metrics.jsonl: a run of this correction is missing")
            runs.append(Run(folder, seed=f"seed{seed}"))
        out.append(Method(arm, runs))
    return out


# ------------------------------------------------------------------------------------------------ the mechanism


def mechanism_section(runs_dir: Path) -> str:
    parts = []
    for title, arms in (
        ("the 15 runs the correlation was found on (three-seed study, levels 1-3, 25 steps)", FIRST_RUNS),
        ("the 19 later 25-step runs (seven-seed GRPO, Clip-Cov preset and KL-Cov seeds 4-7, ratio 0.3 seeds 1-7)",
         LATER_RUNS),
        ("the 14 exploration runs (levels 3-4, 50 steps)", EXPLORE_RUNS),
    ):  # fmt: skip
        parts.append(f"Over {title}:\n" + mechanism_table(mechanism(methods_of(runs_dir, arms))))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------- KL-Cov's endpoint, seed subsets


class LogRatio(NamedTuple):
    seeds: list[int]
    estimate: Estimate  # mean ln(H_kl_cov / H_grpo) over the seeds, 95% t-interval
    t_p: float | None
    sign_p: float | None
    above: int  # seeds in which KL-Cov's entropy was above GRPO's
    difference: Estimate  # the plain difference H_kl_cov - H_grpo


def log_ratio(grpo: dict[int, float], kl_cov: dict[int, float], seeds: Sequence[int]) -> LogRatio:
    """The paired log ratio of two arms' entropies over `seeds` ({seed: entropy} each), with its t-test and sign test,
    and the plain paired difference beside it."""
    d = np.array([math.log(kl_cov[s]) - math.log(grpo[s]) for s in seeds])
    plain = np.array([kl_cov[s] - grpo[s] for s in seeds])
    return LogRatio(list(seeds), mean_interval(d), t_test_p(d), sign_test_p(d), int((d > 0).sum()),
                    mean_interval(plain))  # fmt: skip


def entropies(method: Method, last: int = 10) -> dict[int, float]:
    """{seed number: entropy over the run's last `last` steps}."""
    return {int(s.removeprefix("seed")): v for s, v in seed_values(method, last)[ENTROPY_KEY].items()}


def fmt_est(e: Estimate, spec: str = "+.3f") -> str:
    return f"{e.mean:{spec}} [{e.low:{spec}}, {e.high:{spec}}]" if e.low is not None else f"{e.mean:{spec}}"


def kl_cov_section(runs_dir: Path) -> str:
    grpo, kl = (entropies(m) for m in methods_of(runs_dir, {"grpo": SEVEN, "kl_cov": SEVEN}))
    lines = ["KL-Cov's primary endpoint (levels 1-3, 25 steps): ln(H_kl_cov / H_grpo) over the last 10 steps, paired "
             "by seed; mean [95% t], t-test p, exact sign test p; the plain difference beside it"]  # fmt: skip
    for title, seeds in (
        ("seeds 1-7 (as fixed in advance; seeds 1-3 were seen before the endpoint was chosen)", SEVEN),
        ("seeds 4-7 alone (run after the endpoint was fixed: the confirmatory figure)", range(4, 8)),
        ("seeds 2-7 (without the pair that predates the sampling change)", range(2, 8)),
    ):
        r = log_ratio(grpo, kl, seeds)
        lines.append(
            f"  {title}: {fmt_est(r.estimate)}, t p = {fmt_p(r.t_p)}, sign p = {fmt_p(r.sign_p)}, above GRPO in "
            f"{r.above} of {len(r.seeds)}; geometric mean ratio {math.exp(r.estimate.mean):.2f}x; difference "
            f"{fmt_est(r.difference)}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------- "in every seed", per task


def seeds_section(runs_dir: Path) -> str:
    lines = ["KL-Cov's entropy over GRPO's (last 10 steps), seed by seed, per task:"]
    for title, arms in (
        ("levels 1-3, 25 steps (seven-seed comparison)", {"grpo": SEVEN, "kl_cov": SEVEN}),
        ("levels 3-4, 50 steps (exploration experiment)", {"explore_grpo": SEVEN, "explore_kl_cov": SEVEN}),
    ):
        grpo, kl = (entropies(m) for m in methods_of(runs_dir, arms))
        ratios = {s: kl[s] / grpo[s] for s in sorted(grpo)}
        below = [s for s, r in ratios.items() if r < 1]
        cells = ", ".join(f"{s}: {r:.2f}x" for s, r in ratios.items())
        lines.append(f"  {title}: {cells}; below GRPO in seeds {below or 'none'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- the widths of pass@k intervals


def widths_section(runs_dir: Path) -> str:
    lines = ["Paired pass@k differences against GRPO (final weights), mean [95% t] and the half-width:"]
    three = {a: range(1, 4) for a in ("grpo", "clip_cov", "clip_cov_wide", "kl_cov", "kl_cov_band")}
    seven = {a: SEVEN for a in ("grpo", "clip_cov_wide", "clip_cov_r03", "kl_cov")}
    for title, arms in (("three seeds, levels 1-3", three), ("seven seeds, levels 1-3", seven)):
        lines.append(f"  {title}:")
        found = [c for c in compare(methods_of(runs_dir, arms), "grpo") if c.metric.startswith("pass@")]
        halves = []
        for c in found:
            e = c.test.estimate
            halves.append((e.high_uncut - e.low_uncut) / 2)
            lines.append(f"    {c.method} {c.metric}: {fmt_est(e)} (half-width {halves[-1]:.3f})")
        for method in dict.fromkeys(c.method for c in found):
            mine = [h for c, h in zip(found, halves) if c.method == method]
            lines.append(f"    {method}: half-widths {min(mine):.3f}-{max(mine):.3f}")
        excluding = [c.name for c in found if c.test.estimate.low_uncut > 0 or c.test.estimate.high_uncut < 0]
        lines.append(f"    half-widths {min(halves):.3f}-{max(halves):.3f}; intervals excluding 0: "
                     f"{excluding or 'none'}")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------ the base model's sampling error


def ladder(n: int, ks: Sequence[int]) -> np.ndarray:
    """G[j, c] = the unbiased pass@ks[j] of a prompt with c of its n responses correct, c = 0..n."""
    return np.array([[pass_at_k(n, c, k) for c in range(n + 1)] for k in ks])


def max_entropy_counts(logged: dict[int, float], n: int, tol: float = 1e-9) -> np.ndarray:
    """The distribution w over c = 0..n (a prompt's count of correct responses of n) of largest entropy whose mean
    pass@k equals the logged one at every logged k: w(c) proportional to exp(sum_k lambda_k pass@k(c)), lambda
    found by minimising the convex dual. ValueError when no distribution reproduces the logged values to `tol`."""
    ks = sorted(logged)
    g = ladder(n, ks)
    target = np.array([logged[k] for k in ks])

    def weights(lam: np.ndarray) -> np.ndarray:
        z = lam @ g
        w = np.exp(z - z.max())
        return w / w.sum()

    def dual(lam: np.ndarray) -> float:  # log-partition minus lambda . target: its gradient is E_w[G] - target
        z = lam @ g
        return float(z.max() + math.log(np.exp(z - z.max()).sum()) - lam @ target)

    def gradient(lam: np.ndarray) -> np.ndarray:
        return g @ weights(lam) - target

    def hessian(lam: np.ndarray) -> np.ndarray:  # the covariance of G under w
        w = weights(lam)
        mean = g @ w
        return (g * w) @ g.T - np.outer(mean, mean)

    found = optimize.minimize(dual, np.zeros(len(ks)), jac=gradient, hess=hessian, method="trust-exact",
                              options={"gtol": tol / 10, "maxiter": 500})  # fmt: skip
    w = weights(found.x)
    miss = float(np.abs(g @ w - target).max())
    if miss > tol:
        raise ValueError(f"no count distribution reproduces the logged pass@k (off by {miss:.2g})")
    return w


def binomial_matrix(n: int) -> np.ndarray:
    """B[c, c*] = P(c* correct of n resampled responses | c of the n observed correct) = Binomial(n, c / n)."""
    p = np.arange(n + 1) / n
    return sps.binom.pmf(np.arange(n + 1)[None, :], n, p[:, None])


class BaseError(NamedTuple):
    prompts_and_samples: float  # SD of the bootstrap's pass@k, prompts resampled, then each prompt's responses
    samples_only: float  # SD with the prompts held fixed (the held-out set every run was evaluated on)
    upper_bound: float  # sqrt(m (1 - m) / prompts), m the mean: resampling prompts alone, whatever their counts


def bootstrap_sd(w: np.ndarray, n: int, k: int, prompts: int) -> BaseError:
    """The exact (infinitely resampled) bootstrap SD of a mean pass@k over `prompts` prompts whose correct counts
    are distributed as w over 0..n: resampling the prompts (c drawn from w) and then each prompt's n responses with
    replacement (c* ~ Binomial(n, c / n)); and with the prompts fixed, the responses alone."""
    g = ladder(n, [k])[0]
    b = binomial_matrix(n)
    first, second = b @ g, b @ g**2  # E[pass@k(c*) | c], E[pass@k(c*)^2 | c]
    mean = w @ first
    both = max(w @ second - mean**2, 0.0) / prompts
    within = max(w @ (second - first**2), 0.0) / prompts
    m = w @ g
    return BaseError(math.sqrt(both), math.sqrt(within), math.sqrt(m * (1 - m) / prompts))


class MinusBase(NamedTuple):
    name: str
    mean: float
    low: float
    high: float
    df: float
    t_p: float
    uncorrected: Estimate  # the one-sample t-interval as first reported (the base taken as exact)
    uncorrected_p: float | None


def minus_constant(name: str, values: Sequence[float], base: float, base_sd: float) -> MinusBase:
    """mean(values) - base, where base is itself an estimate with standard error base_sd, independent of the values:
    Welch's t with the variance s^2 / n + base_sd^2 and Satterthwaite's degrees of freedom (the base's error
    counted as known: its own degrees of freedom infinite)."""
    x = np.asarray(values, dtype=float)
    n = x.size
    v_runs = float(x.var(ddof=1)) / n
    var = v_runs + base_sd**2
    df = var**2 / (v_runs**2 / (n - 1))
    se = math.sqrt(var)
    mean = float(x.mean()) - base
    half = t95(df) * se
    p = float(2 * sps.t.sf(abs(mean) / se, df))
    return MinusBase(name, mean, mean - half, mean + half, df, p, mean_interval(x - base), t_test_p(x - base))


def base_counts(base_metrics: dict[str, float], levels: Sequence[str]) -> dict[str, tuple[np.ndarray, int]]:
    """{source: (the reconstructed count distribution, n)} from the base model's per-source eval/<source>/pass@k."""
    out = {}
    for src in levels:
        logged = {}
        for key, value in base_metrics.items():
            prefix = f"eval/{src}/pass@"
            if key.startswith(prefix) and key[len(prefix) :].isdigit():
                logged[int(key[len(prefix) :])] = float(value)
        n = max(logged)
        out[src] = (max_entropy_counts(logged, n), n)
    return out


def base_section(runs_dir: Path, prompts: int = 48) -> str:
    base_metrics = json.loads((runs_dir / "explore_base" / "metrics.json").read_text())
    sources = sorted({k.split("/")[1] for k in base_metrics if k.count("/") == 2})
    counts = base_counts(base_metrics, sources)
    k = explore.PRIMARY_K
    lines = [
        f"The base model's pass@{k}: {base_metrics[f'eval/pass@{k}']:.3f}, one sampled evaluation (64 samples of "
        f"{prompts} prompts per level). Its per-prompt counts were not logged: per level, the maximum-entropy count "
        f"distribution reproducing its seven logged pass@k; then the exact bootstrap SD of pass@{k}:"
    ]
    errors = {}
    for src, (w, n) in counts.items():
        errors[src] = e = bootstrap_sd(w, n, k, prompts)
        sd_p1 = math.sqrt(w @ (np.arange(n + 1) / n) ** 2 - (w @ (np.arange(n + 1) / n)) ** 2)
        low, high = base_metrics[f"eval/{src}/pass@1_ci95_low"], base_metrics[f"eval/{src}/pass@1_ci95_high"]
        lines.append(
            f"  {src}: SD {e.prompts_and_samples:.4f} (prompts and samples), {e.samples_only:.4f} (samples, prompts "
            f"fixed), bound {e.upper_bound:.4f}; check: the reconstruction's spread of pass@1 over prompts gives a "
            f"95% half-width {1.96 * sd_p1 / math.sqrt(prompts):.3f}, the logged bootstrap's {(high - low) / 2:.3f}"
        )
    # the average over sources: the sources' errors are independent
    combined = {
        field: math.sqrt(sum(getattr(e, field) ** 2 for e in errors.values())) / len(errors)
        for field in BaseError._fields
    }
    lines.append(
        f"  averaged over the levels: SD {combined['prompts_and_samples']:.4f} (prompts and samples), "
        f"{combined['samples_only']:.4f} (samples only), bound {combined['upper_bound']:.4f}"
    )
    pairs = explore.find_pairs(runs_dir)
    base = explore.read_base(runs_dir / "explore_base" / "metrics.json")
    a = explore.analyse(pairs, base)
    grpo, kl = explore.ARMS
    for field, title in (("prompts_and_samples", "prompts and samples"), ("samples_only", "samples only"),
                         ("upper_bound", "the bound")):  # fmt: skip
        sd = combined[field]
        tests = [
            minus_constant(f"pass@{k}, GRPO - base", [r[f"{grpo}:final@{k}"] for r in a.per_seed], base[k], sd),
            minus_constant(f"pass@{k}, KL-Cov - base", [r[f"{kl}:final@{k}"] for r in a.per_seed], base[k], sd),
        ]
        others = [1.0 if t.t_p is None else t.t_p for t in a.secondary[2:]]
        adjusted = holm([t.t_p for t in tests] + others)
        lines.append(f"Arm minus base with the base's error ({title}, SD {sd:.4f}); Welch t, Holm over the five:")
        for t, h in zip(tests, adjusted):
            u = t.uncorrected
            lines.append(
                f"  {t.name}: {t.mean:+.3f} [{t.low:+.3f}, {t.high:+.3f}], df {t.df:.1f}, t p = {fmt_p(t.t_p)}, Holm "
                f"p = {fmt_p(h)}   (the base as exact: [{u.low:+.3f}, {u.high:+.3f}], t p = {fmt_p(t.uncorrected_p)})"
            )
        for t, h in zip(a.secondary[2:], adjusted[2:]):
            lines.append(f"  {t.name}: t p = {fmt_p(t.t_p)}, Holm p = {fmt_p(h)} (unchanged test)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the chance baseline


def _add_or_sub(level: int, a_range: range, b_range: range) -> list[tuple[float, tuple, int]]:
    draws = []
    p = 1 / (len(a_range) * len(b_range))
    for a in a_range:
        for b in b_range:
            draws.append((0.5 * p, (level, "+", min(a, b), max(a, b)), a + b))
            draws.append((0.5 * p, (level, "-", max(a, b), min(a, b)), max(a, b) - min(a, b)))
    return draws


def problem_draws(level: int) -> list[tuple[float, tuple, int]]:
    """Every (probability, arithmetic key, answer) one draw of the task generator's problem at `level` can give
    (entropy_openrlhf/data/arith_task.py, `_problem`), before the split is chosen."""
    if level == 1:
        return _add_or_sub(1, range(1, 10), range(1, 10))
    if level == 2:
        return _add_or_sub(2, range(10, 100), range(1, 10))
    if level == 3:
        draws = []
        for a in range(2, 10):
            for b in range(2, 10):
                draws.append((0.5 / 64, (3, "*", min(a, b), max(a, b)), a * b))
        for a in range(2, 10):
            for b in range(1, 10):
                top = min(9, a + b)
                for c in range(1, top + 1):
                    draws.append((0.5 / (8 * 9 * top), (3, "+-", min(a, b), max(a, b), c), a + b - c))
        return draws
    if level == 4:
        return _add_or_sub(4, range(10, 100), range(10, 100))
    raise ValueError(f"unknown level {level}")


def answer_distribution(level: int, split: str = "test") -> dict[int, float]:
    """{answer: probability} of a problem of `level` in `split`: the generator redraws until a problem lands in the
    split and is not a worked example, so the draws are conditioned on that."""
    examples = {key for *_, key in EXAMPLES}
    kept: dict[int, float] = {}
    for p, key, answer in problem_draws(level):
        if in_test_split(key) == (split == "test") and key not in examples:
            kept[answer] = kept.get(answer, 0.0) + p
    total = sum(kept.values())
    return {answer: p / total for answer, p in sorted(kept.items())}


def chance_pass_at_k(answers: Sequence[int], q: dict[int, float], k: int) -> float:
    """pass@k of a policy that answers each prompt with a number drawn from q, independently each time: per prompt
    1 - (1 - q(answer))^k (the unbiased estimator's expectation), averaged over the prompts."""
    return float(np.mean([1 - (1 - q.get(a, 0.0)) ** k for a in answers]))


def expected_chance(q: dict[int, float], k: int) -> float:
    """The same over the split itself: answers drawn from q too."""
    return float(sum(p * (1 - (1 - p) ** k) for p in q.values()))


def final_by_level(run: Run, level: int, k: int) -> float:
    """A run's pass@k on one level's prompts (`eval/arith_l<level>/pass@k`) at its final weights."""
    versions, values = run.pairs("eval/policy_version", f"eval/arith_l{level}/pass@{k}")
    found = {int(v): float(x) for v, x in zip(versions, values)}
    if explore.STEPS not in found:
        raise ValueError(f"{run.source}: no eval/arith_l{level}/pass@{k} of the final weights")
    return found[explore.STEPS]


def chance_section(runs_dir: Path) -> str:
    rows = [json.loads(line) for line in (runs_dir / "explore_base" / "heldout.jsonl").read_text().splitlines()]
    levels = sorted({int(r["level"]) for r in rows})
    base = explore.read_base(runs_dir / "explore_base" / "metrics.json")
    base_metrics = json.loads((runs_dir / "explore_base" / "metrics.json").read_text())
    pairs = explore.find_pairs(runs_dir)
    a = explore.analyse(pairs, base)
    arms = {d.name: (d.grpo.mean, d.kl_cov.mean) for d in a.final}
    lines = ["Chance: a policy answering with a number drawn from the level's answer distribution (the generator's "
             "test split), on the held-out set of the exploration experiment; pass@k averaged over the levels as "
             "the evaluation averages its sources:"]  # fmt: skip
    per_level = {}
    for level in levels:
        q = answer_distribution(level)
        answers = [int(r["label"]) for r in rows if int(r["level"]) == level]
        per_level[level] = {k: chance_pass_at_k(answers, q, k) for k in CHANCE_KS}
        cells = ", ".join(f"pass@{k} {per_level[level][k]:.3f} (over the split {expected_chance(q, k):.3f})"
                          for k in CHANCE_KS)  # fmt: skip
        lines.append(f"  level {level} ({len(answers)} prompts, {len(q)} possible answers, the likeliest at "
                     f"{max(q.values()):.3f}): {cells}")  # fmt: skip
        for k in CHANCE_KS:
            grpo, kl = ([final_by_level(arms_[arm], level, k) for arms_ in pairs.values()] for arm in explore.ARMS)
            lines.append(
                f"    pass@{k} on level {level}: base model {base_metrics[f'eval/arith_l{level}/pass@{k}']:.3f}, GRPO "
                f"{fmt_est(mean_interval(grpo), '.3f')}, KL-Cov {fmt_est(mean_interval(kl), '.3f')} (final weights, "
                "seven runs)"
            )
    for k in CHANCE_KS:
        chance = float(np.mean([per_level[level][k] for level in levels]))
        grpo, kl = arms.get(f"pass@{k}", (float("nan"), float("nan")))
        lines.append(f"  pass@{k}: chance {chance:.3f}; base model {base[k]:.3f}, GRPO {grpo:.3f}, KL-Cov {kl:.3f} "
                     "(final weights, mean over the seven runs)")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- the resumed runs' step


def staleness_zero_steps(path: Path) -> list[int]:
    """The steps after a run's first whose batch was trained at staleness 0 (`async/staleness_mean` 0)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    logged = [(int(r["step"]), float(r[STALENESS_KEY])) for r in rows if STALENESS_KEY in r]
    if not logged:
        return []
    first = min(s for s, _ in logged)
    return sorted(s for s, v in logged if v == 0 and s > first)


def staleness_section(runs_dir: Path) -> str:
    found = {p.parent.name: steps for p in sorted(runs_dir.glob("*/metrics.jsonl"))
             if (steps := staleness_zero_steps(p))}  # fmt: skip
    total = len(list(runs_dir.glob("*/metrics.jsonl")))
    cells = ", ".join(f"{name} (step {', '.join(map(str, steps))})" for name, steps in found.items())
    return f"Runs trained at staleness 0 at a step after their first: {len(found)} of {total}: {cells}"


SECTIONS = {
    "mechanism": mechanism_section,
    "kl_cov": kl_cov_section,
    "seeds": seeds_section,
    "widths": widths_section,
    "base": base_section,
    "chance": chance_section,
    "staleness": staleness_section,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=str(RUNS), help="the folder holding the committed runs")
    p.add_argument("--only", choices=sorted(SECTIONS), action="append", help="print this section (repeatable)")
    args = p.parse_args(argv)
    try:
        for name in args.only or SECTIONS:
            print(SECTIONS[name](Path(args.runs)) + "\n")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
