"""The small-scale study's tooling: several runs side by side, one method per label with one or several seeds.

runs.py       reading runs (study/runs/<arm>_seed<N>/metrics.jsonl, output folders, older W&B folders, CSVs), each run's
              figures: final entropy and accuracy, pass@k, the share of steps in a band, the mechanism's points
stats.py      the statistics, free of runs: t-intervals, paired tests (t, sign, Wilcoxon), power, Holm's
              correction, Pearson and partial correlation with Fisher and run-level bootstrap intervals
figures.py    the PNGs
tables.py     the report's descriptive tables (markdown): values per method, seed by seed, pass@k, the fits
inference.py  the report's paired comparisons with their p-values and power, Holm's correction and the mechanism
              check
plot_runs.py  the command line: python -m study.plot_runs LABEL=PATH ... (from the repository root)
explore.py    the exploration experiment's analysis, as fixed before its runs: python -m study.explore
corrections.py  the write-up's corrections of 2026-12-02 (study/notebook.md, "Corrections"): python -m
              study.corrections
asynchrony.py the asynchrony experiment's analysis and power calculation, fixed before its runs: python -m
              study.asynchrony (--power)
entropy_curve.py  exploratory: KL-Cov's (entropy, accuracy) points against GRPO's fitted entropy law: python -m
              study.entropy_curve
"""
