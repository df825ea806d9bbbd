"""Plot and tabulate several runs side by side, one line per method, with one or several seeds per method: entropy
and accuracy against step, pass@k against k, the entropy law R = -a exp(H) + b fitted per method, and the paper's
mechanism (each step's entropy change against its covariance).

    python -m study.plot_runs grpo=outputs/grpo kl_cov=outputs/kl_cov clip_cov=runs/clip_cov.csv --out docs/
    python -m study.plot_runs grpo=study/runs/grpo_seed1 grpo=study/runs/grpo_seed2 grpo=study/runs/grpo_seed3 \
        kl_cov=study/runs/kl_cov_seed1 kl_cov=study/runs/kl_cov_seed2 kl_cov=study/runs/kl_cov_seed3 \
        --out study/figures --prefix study_ --band 0.5,0.8

Each run is LABEL=PATH (or just PATH: the label is then the folder or file name). PATH is a folder holding
metrics.jsonl (a pipeline's --train.output_dir, study/runs/<run>), a W&B offline run folder of a run from before
metrics.jsonl moved to the output folder (it holds files/metrics.jsonl), a folder with exactly one such run below
it, or a CSV with a `step` column and one column per metric. A label given several times names one method's seeds
(different runs). Seeds are paired with the baseline's by the `seed<N>` in their paths (grpo_seed2 with
kl_cov_seed2: same data and first rollouts), else by their order on the command line.

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
  train accuracy (last --last steps) and held-out accuracy (last evaluation): the table of study/notebook.md.
  `--band LO,HI` (an entropy controller's `--entropy.target`) shades the band on the entropy plot and adds a column:
  the share of each run's last --last steps whose entropy was inside it.
- several seeds for some method: the same figures, each run's value as above, as a mean over the method's seeds
  with a 95% t-interval over them (n seeds, n - 1 degrees of freedom; no interval with one seed; cut to the range
  the quantity can take, [0, 1] for accuracies and shares, a cut bound marked * and the uncut interval given in a
  footnote), the band column as the share of steps from --band-from (5) on inside the band; then each method minus
  --baseline, paired by seed: the mean of the per-seed differences with its t-interval, "excludes 0" or "not
  significant at n seeds", the two-sided p of the t-test, the exact sign test and the Wilcoxon signed-rank test, the
  t-test's power at the observed mean and SD of the differences and the pairs it would need for 80% power; for
  entropy also the log ratio ln(method / baseline) per seed; then Holm's correction over every paired t-test
  printed, and over each --family on its own (a pre-registered set of endpoints); then every run on its own
  row, seed by seed: its entropy, that over the baseline's of the same seed, pass@1 and pass@<largest k>, the band
  share (whether a method beat the baseline in every seed, which a mean hides); then, for Clip-Cov and KL-Cov runs,
  how much each selected: its share of tokens, for Clip-Cov of those inside the bounds, and of micro-batches starved.
- pass@k at each run's last evaluation (mean and interval over seeds), when logged: every k a run logged
  (`eval/pass@<k>`, the average over sources). A run without pass@k is left out of it with a note; a run whose last
  pass@k comes before its last step (its final weights were not evaluated) gets a note;
- each method's fit (a, b, the ceiling b - a, RMSE). The fit uses `--fit-acc`; `auto` is `eval/acc` when the
  method's runs hold at least two evaluations between them, else `reward/acc`;
- the mechanism check: Pearson r of cov/mean[t] against the next step's entropy change, over all runs and per method,
  with its Fisher interval; the partial r with entropy[t] held fixed; for both a run-level bootstrap interval (whole
  runs resampled within each method: a run's steps are autocorrelated). The paper's claim is that the entropy change
  follows minus the covariance: r < 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from study.figures import plot_runs
from study.inference import compare, holm_tables, mechanism_table, paired_table
from study.runs import EVAL_ACC_KEY, Method, group_methods, mechanism, parse_run, pass_at_k_curves
from study.tables import (
    ceiling_table,
    fit_table,
    pass_at_k_table,
    per_seed_table,
    results_table,
    seeds_table,
    selection_table,
)


def parse_band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--band: expected LO,HI (two numbers), got {text!r}") from None
    if not lo < hi:
        raise ValueError(f"--band: LO must be below HI, got {text!r}")
    return lo, hi


def report(args: argparse.Namespace, methods: list[Method], band: tuple[float, float] | None) -> list[str]:
    """The printed sections, in order; built before anything is printed, so a bad --family fails with one line."""
    sections = []
    if any(len(m.runs) > 1 for m in methods):
        sections.append(seeds_table(methods, args.baseline, args.last, band, args.band_from))
        comparisons = compare(methods, args.baseline, args.last, band, args.band_from)
        paired = paired_table(methods, args.baseline, comparisons)
        if paired:
            sections.append(paired)
        sections += holm_tables(comparisons, args.baseline, args.family)
        sections.append(per_seed_table(methods, args.baseline, args.last, band, args.band_from))
        if selection := selection_table(methods):
            sections.append(selection)
    elif args.family:
        raise ValueError("--family: the paired tests need several seeds of a method and of --baseline")
    else:
        sections.append(results_table(methods, args.baseline, args.last, band))
    if band is not None:
        sections.append(ceiling_table(methods, band, args.band_from))
    curves = pass_at_k_curves(methods)
    if curves:
        sections.append(pass_at_k_table(curves))
    sections.append(fit_table(methods))
    if mech := mechanism_table(mechanism(methods)):
        sections.append(mech)
    return sections


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="a run folder, a folder with one run, or a CSV")
    p.add_argument("--out", default="study/figures", help="folder the PNGs go in")
    p.add_argument("--prefix", default="", help="file-name prefix of the PNGs, e.g. arith_")
    p.add_argument("--fit-acc", default="auto", help=f"accuracy metric of the fit: auto | {EVAL_ACC_KEY} | ...")
    p.add_argument("--baseline", default="grpo", help="label of the method the others are compared with")
    p.add_argument("--last", type=int, default=10, help="the table averages each metric over the last N steps")
    p.add_argument("--band", default="", metavar="LO,HI", help="an entropy target band to shade and score runs by")
    p.add_argument("--band-from", type=float, default=5, help="with seeds, the band share counts steps from this on")
    p.add_argument(
        "--family",
        action="append",
        default=[],
        metavar="METHOD:METRIC,...",
        help="a family of paired tests Holm-corrected on its own (repeatable), e.g. kl_cov:train_acc,kl_cov:pass@*; "
        "METRIC is entropy, log_entropy_ratio, train_acc, test_acc, band or pass@<k>; shell wildcards allowed",
    )
    args = p.parse_args(argv)
    try:
        band = parse_band(args.band) if args.band else None
        methods = group_methods([parse_run(spec) for spec in args.runs])
        written = plot_runs(methods, Path(args.out), args.prefix, args.fit_acc, band)
        sections = report(args, methods, band)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(sections))
    for m in methods:
        for note in dict.fromkeys(m.notes):  # pass@k is looked at by both the plot and the table: one note each
            print(f"note: {m.label}: {note}")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
