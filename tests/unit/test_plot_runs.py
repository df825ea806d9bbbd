"""The study's command line (python -m study.plot_runs) on synthetic runs: the PNGs are written, each method's
entropy law is recovered and the printed tables hold what the runs say."""

import csv
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest, ttest_1samp, wilcoxon
from scipy.stats import t as student_t

from study import plot_runs as cli
from study.figures import plot_runs
from study.runs import (
    Run,
    across_runs,
    band_ceiling,
    controller_moved,
    cov_entropy_points,
    fit_run,
    group_methods,
    parse_run,
    pass_at_k_curves,
)
from study.stats import mean_interval, paired_difference, pearson_interval, t95

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# (a, b) per method; entropy decays at a different speed for each, as GRPO's collapses fastest
METHODS = {"grpo": (0.40, 0.90, 8.0), "clip_cov": (0.30, 0.85, 25.0), "kl_cov": (0.25, 0.80, 60.0)}


def synthetic_records(a: float, b: float, tau: float, n: int = 60, eval_every: int = 0, seed: int = 0):
    """One logged dict per step: entropy falling from 1.5, accuracy on R = -a exp(H) + b plus a little noise."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(n):
        h = 0.05 + 1.45 * np.exp(-step / tau)
        rec = {"step": step, "entropy/seq_mean": h, "reward/acc": -a * np.exp(h) + b + rng.normal(0, 0.002)}
        rec["time/step"] = 30.0  # other metrics are ignored
        if eval_every and step % eval_every == 0:
            rec["eval/acc"] = -a * np.exp(h) + b - 0.05 + rng.normal(0, 0.002)  # held-out: lower, same shape
        records.append(rec)
    return records


def write_run_folder(root: Path, records: list[dict], wandb: bool = False) -> Path:
    """The layout the trainer leaves: <output_dir>/metrics.jsonl. `wandb`: the layout of runs from before it moved
    there, <output_dir>/wandb/offline-run-<time>-<id>/files/metrics.jsonl."""
    run = root / "wandb" / "offline-run-20260101_000000-abc123" if wandb else root
    path = run / "files" / "metrics.jsonl" if wandb else run / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def run_script(*args) -> subprocess.CompletedProcess:
    """The command line as the docs give it: python -m study.plot_runs from the repository root."""
    command = [sys.executable, "-m", "study.plot_runs", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """The script's main() in this process (the subprocess test above covers the command line itself)."""
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} not written"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5_000, f"{path} is not a plausible PNG ({len(data)} bytes)"


def test_writes_every_png_and_recovers_each_methods_law(tmp_path):
    specs = []
    for i, (name, (a, b, tau)) in enumerate(METHODS.items()):
        # the run's output folder; for one method, that of a run from before metrics.jsonl moved there, where the
        # script finds the single W&B folder below it
        write_run_folder(tmp_path / name, synthetic_records(a, b, tau, seed=i), wandb=name == "clip_cov")
        specs.append(f"{name}={tmp_path / name}")
    out = tmp_path / "plots"
    result = run_script(*specs, "--out", out, "--prefix", "arith_")
    assert result.returncode == 0, result.stderr
    for name in ("entropy", "accuracy", "entropy_law", "fit_grpo", "fit_clip_cov", "fit_kl_cov"):
        assert_png(out / f"arith_{name}.png")

    # the printed table: method, accuracy key, points, a, b, b - a, rmse
    table = [line.split() for line in result.stdout.splitlines()]
    rows = {cells[0]: cells for cells in table if cells and cells[0] in METHODS}
    for name, (a, b, _) in METHODS.items():
        _, key, points, fa, fb, ceiling, rmse = rows[name]
        assert key == "reward/acc" and int(points) == 60  # no eval/acc logged: the fit falls back to train accuracy
        assert float(fa) == pytest.approx(a, abs=0.01)
        assert float(fb) == pytest.approx(b, abs=0.01)
        assert float(ceiling) == pytest.approx(b - a, abs=0.01)
        assert float(rmse) < 0.005


def test_fit_prefers_eval_accuracy_and_reads_csv(tmp_path):
    a, b, tau = METHODS["kl_cov"]
    records = synthetic_records(a, b, tau, eval_every=5)
    folder = write_run_folder(tmp_path / "kl", records)
    csv_path = tmp_path / "grpo.csv"
    grpo = synthetic_records(*METHODS["grpo"])
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "entropy/seq_mean", "reward/acc", "time/step"])
        writer.writeheader()
        writer.writerows(grpo)

    runs = [parse_run(f"kl_cov={folder}"), parse_run(str(csv_path))]
    assert runs[1].label == "grpo"  # no label given: the file name
    written = plot_runs(runs, tmp_path / "out")
    names = {"entropy.png", "accuracy.png", "entropy_law.png", "fit_kl_cov.png", "fit_grpo.png"}
    assert {p.name for p in written} == names
    for p in written:
        assert_png(p)
    kl, csv_run = runs
    # 12 evaluations (steps 0, 5, ..., 55) on the held-out curve, 0.05 below the training one
    assert kl.fit_key == "eval/acc" and kl.fit.n_points == 12
    assert kl.fit.a == pytest.approx(a, abs=0.02) and kl.fit.b == pytest.approx(b - 0.05, abs=0.02)
    assert csv_run.fit_key == "reward/acc" and csv_run.fit.n_points == 60
    assert csv_run.fit.a == pytest.approx(METHODS["grpo"][0], abs=0.01)

    # an explicit key overrides auto
    forced = parse_run(f"kl_cov={folder}")
    fit_run(forced, "reward/acc")
    assert forced.fit_key == "reward/acc" and forced.fit.n_points == 60


def test_a_run_without_entropy_spread_is_plotted_but_not_fitted(tmp_path, capsys):
    flat = [{"step": s, "entropy/seq_mean": 0.7, "reward/acc": 0.3 + 0.001 * s} for s in range(10)]
    ok = write_run_folder(tmp_path / "ok", synthetic_records(*METHODS["grpo"]))
    bad = write_run_folder(tmp_path / "flat", flat)
    code, out, err = run_main(capsys, f"grpo={ok}", f"flat={bad}", "--out", tmp_path / "out")
    assert code == 0, err
    assert "flat" in out and "not fitted" in out
    assert "same entropy" in out  # the note says why
    assert_png(tmp_path / "out" / "fit_grpo.png")
    assert not (tmp_path / "out" / "fit_flat.png").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "missing", "no such file or folder"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "no run folder"),
        (lambda root: [write_run_folder(root / "two" / x, []) for x in "ab"] and root / "two", "2 run folders"),
        (
            lambda root: [write_run_folder(root / "two" / x, [], wandb=True) for x in "ab"] and root / "two",
            "2 run folders",
        ),
    ],
)
def test_bad_run_paths_fail_with_one_line(tmp_path, capsys, make, message):
    code, _, err = run_main(capsys, f"x={make(tmp_path)}", "--out", tmp_path / "out")
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_runs_without_the_metrics_fail(tmp_path, capsys):
    run = write_run_folder(tmp_path / "r", [{"step": 0, "time/step": 1.0}])
    code, _, err = run_main(capsys, f"r={run}", "--out", tmp_path / "out")
    assert code == 2 and "entropy/seq_mean" in err


def test_duplicate_labels_are_refused(tmp_path, capsys):
    run = write_run_folder(tmp_path / "r", synthetic_records(*METHODS["grpo"]))
    code, _, err = run_main(capsys, f"a={run}", f"a={run}", "--out", tmp_path / "out")
    assert code == 2 and "labels must differ" in err


def test_results_table_holds_final_values_and_entropy_ratio(tmp_path, capsys):
    # hand-made runs: the table's figures can be worked out from these few numbers
    grpo = [{"step": s, "entropy/seq_mean": h, "reward/acc": acc} for s, h, acc in [(0, 1.0, 0.1), (1, 0.2, 0.5)]]
    kl = [{"step": s, "entropy/seq_mean": h, "reward/acc": acc} for s, h, acc in [(0, 1.0, 0.1), (1, 0.8, 0.3)]]
    kl[1]["eval/acc"] = 0.45
    write_run_folder(tmp_path / "grpo", grpo)
    write_run_folder(tmp_path / "kl", kl)
    code, out, err = run_main(
        capsys,
        f"grpo={tmp_path / 'grpo'}",
        f"kl_cov={tmp_path / 'kl'}",
        "--out",
        tmp_path / "p",
        "--fit-acc",
        "reward/acc",
    )
    assert code == 0, err
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.splitlines()
        if line.startswith("| ") and "method" not in line
    }
    # the last 10 values of a 2-step run are both: grpo entropy (1.0+0.2)/2 = 0.6, kl_cov (1.0+0.8)/2 = 0.9, ratio 1.5
    assert rows["grpo"] == ["2", "0.6000", "1.00", "0.300", "n/a"]
    assert rows["kl_cov"] == ["2", "0.9000", "1.50", "0.200", "0.450"]


def test_band_scores_the_share_of_last_steps_inside_it(tmp_path, capsys):
    # entropies chosen so the share can be counted by hand: band [0.5, 0.8], ends included
    values = {"grpo": [0.9, 0.7, 0.4, 0.3], "ctl": [0.9, 0.5, 0.8, 0.6]}
    for name, hs in values.items():
        records = [{"step": s, "entropy/seq_mean": h, "reward/acc": 0.1 * s} for s, h in enumerate(hs)]
        write_run_folder(tmp_path / name, records)
    args = [f"{name}={tmp_path / name}" for name in values]
    code, out, err = run_main(capsys, *args, "--out", tmp_path / "p", "--band", "0.5,0.8", "--last", "3")
    assert code == 0, err
    assert "in [0.5, 0.8] (last 3)" in out
    share = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in out.splitlines() if "| 4 |" in line}
    # grpo's last three: 0.7 in, 0.4 and 0.3 out; ctl's last three: 0.5, 0.8 (the ends) and 0.6 all in
    assert share == {"grpo": "33%", "ctl": "100%"}
    assert_png(tmp_path / "p" / "entropy.png")


@pytest.mark.parametrize("band", ["0.8,0.5", "0.5", "low,high"])
def test_a_bad_band_fails_with_one_line(tmp_path, capsys, band):
    run = write_run_folder(tmp_path / "r", synthetic_records(*METHODS["grpo"]))
    code, _, err = run_main(capsys, f"r={run}", "--out", tmp_path / "out", "--band", band)
    assert code == 2 and "--band" in err and err.count("\n") == 1


# ---- several seeds per method: the study's layout, study/runs/<method>_seed<N>/metrics.jsonl ----

STUDY_KS = (1, 2, 4, 8, 16)
T95_2DF = 4.302653  # Student's t, 0.975 quantile, 2 degrees of freedom (three seeds), from a printed table
Z975 = 1.959964


def study_records(cov_mean: float, seed: int, n: int = 25, eval_every: int = 5, with_pass: bool = True):
    """One run of the study: entropy moved by minus the step's covariance (the paper's law) plus noise, evaluations
    every `eval_every` steps and on the final weights (the last row), pass@k rising with k."""
    rng = np.random.default_rng(seed)
    h, records = 0.7, []
    for step in range(n):
        cov = cov_mean + rng.normal(0, 0.01)
        rec = {"step": step, "entropy/seq_mean": h, "reward/acc": 0.2 + 0.01 * step + rng.normal(0, 0.05)}
        rec["cov/mean"] = cov
        if step % eval_every == 0 or step == n - 1:
            rec["eval/acc"] = 0.3 + 0.004 * step + rng.normal(0, 0.02)
            rec["eval/policy_version"] = float(step)
            if with_pass:
                for k in STUDY_KS:
                    rec[f"eval/pass@{k}"] = min(1.0, 0.25 + 0.08 * np.log2(k) + 0.002 * step + rng.normal(0, 0.02))
                rec["eval/pass@1_ci95_low"] = rec["eval/pass@1"] - 0.05  # not a k: must not become a column
                rec["eval/arith_l1/pass@1"] = 0.9  # per source: not the average either
        records.append(rec)
        h = h - cov + rng.normal(0, 0.005)
    return records


def write_study(root: Path, methods: dict[str, float], seeds=(1, 2, 3), **kwargs) -> dict[str, dict[int, list]]:
    """study/runs/<method>_seed<N>/metrics.jsonl for every method and seed; returns the records written."""
    written = {}
    for m_index, (method, cov_mean) in enumerate(methods.items()):
        written[method] = {}
        for seed in seeds:
            records = study_records(cov_mean, seed=100 * m_index + seed, **kwargs)
            folder = root / f"{method}_seed{seed}"
            folder.mkdir(parents=True)
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            written[method][seed] = records
    return written


def study_specs(root: Path, written: dict) -> list[str]:
    return [f"{method}={root / f'{method}_seed{seed}'}" for method, seeds in written.items() for seed in seeds]


def by_hand(values, bounds=(0.0, 1.0)) -> tuple[float, float, float]:
    """Mean and 95% t-interval of three values, with the standard library only, cut to the quantity's range."""
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = T95_2DF * sd / math.sqrt(len(values))
    return mean, max(mean - half, bounds[0]), min(mean + half, bounds[1])


def markdown_rows(out: str, header_start: str) -> dict[str, list[str]]:
    """The rows of the printed markdown table whose header starts with `header_start`: first cell -> other cells."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows.setdefault(cells[0], []).append(cells[1:])
    return {k: v[0] if len(v) == 1 else v for k, v in rows.items()}


def numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.?\d*", cell)]


STUDY = {"grpo": 0.02, "kl_cov": 0.0, "clip_cov": 0.015}


def test_seeds_table_holds_means_and_t_intervals_over_seeds(tmp_path, capsys):
    written = write_study(tmp_path, STUDY)
    out_dir = tmp_path / "plots"
    specs = study_specs(tmp_path, written)
    code, out, err = run_main(capsys, *specs, "--out", out_dir, "--prefix", "study_", "--band", "0.5,0.8")
    assert code == 0, err
    rows = markdown_rows(out, "| method | seeds |")
    assert set(rows) == set(STUDY)
    grpo_entropy = statistics.mean(
        statistics.mean(r["entropy/seq_mean"] for r in recs[-10:]) for recs in written["grpo"].values()
    )
    for method, seeds in written.items():
        n_seeds, steps, entropy, ratio, train, test, band = rows[method]
        assert (n_seeds, steps) == ("3", "25")
        per_seed = {
            "entropy": [statistics.mean(r["entropy/seq_mean"] for r in recs[-10:]) for recs in seeds.values()],
            "train": [statistics.mean(r["reward/acc"] for r in recs[-10:]) for recs in seeds.values()],
            "test": [[r["eval/acc"] for r in recs if "eval/acc" in r][-1] for recs in seeds.values()],
            # the band share counts the steps from 5 on: 20 of the 25
            "band": [statistics.mean(0.5 <= r["entropy/seq_mean"] <= 0.8 for r in recs[5:]) for recs in seeds.values()],
        }
        assert numbers(entropy) == pytest.approx(by_hand(per_seed["entropy"], (0, math.inf)), abs=6e-4), entropy
        for cell, key in ((train, "train"), (test, "test")):
            assert numbers(cell) == pytest.approx(by_hand(per_seed[key]), abs=6e-4), (method, key, cell)
        # a share's interval is cut to [0%, 100%] (grpo's three seeds spread so far that t * s / sqrt(3) passes 0)
        assert numbers(band) == pytest.approx([100 * v for v in by_hand(per_seed["band"])], abs=0.6), band
        assert 0 <= numbers(band)[1] and numbers(band)[2] <= 100
        assert float(ratio) == pytest.approx(statistics.mean(per_seed["entropy"]) / grpo_entropy, abs=0.006)

    # pass@k at the last evaluation (the final row), never the midway one, never the _ci95 or per-source keys
    passk = markdown_rows(out, "| method | runs |")
    head = next(line for line in out.splitlines() if line.startswith("| method | runs |"))
    assert head == "| method | runs | pass@1 | pass@2 | pass@4 | pass@8 | pass@16 |"
    for method, seeds in written.items():
        for k, cell in zip(STUDY_KS, passk[method][1:]):
            final = [recs[-1][f"eval/pass@{k}"] for recs in seeds.values()]
            assert numbers(cell) == pytest.approx(by_hand(final), abs=6e-4), (method, k, cell)

    for name in ("entropy", "accuracy", "pass_at_k", "cov_entropy", "entropy_law", "fit_grpo", "fit_kl_cov"):
        assert_png(out_dir / f"study_{name}.png")
    assert "note:" not in out


def test_paired_difference_pairs_seeds_by_number_and_says_when_not_significant(tmp_path, capsys):
    written = write_study(tmp_path, {"grpo": 0.02, "kl_cov": 0.0})
    # kl_cov's seeds in another order on the command line: pairing follows seed<N> in the path, not the order
    specs = [f"grpo={tmp_path / f'grpo_seed{s}'}" for s in (1, 2, 3)]
    specs += [f"kl_cov={tmp_path / f'kl_cov_seed{s}'}" for s in (3, 1, 2)]
    code, out, err = run_main(capsys, *specs, "--out", tmp_path / "p")
    assert code == 0, err
    rows = markdown_rows(out, "| method - grpo |")["kl_cov"]
    by_metric = {cells[0]: cells[1:] for cells in rows}

    def last10(recs, key):
        return statistics.mean(r[key] for r in recs[-10:])

    for metric, key in (("entropy (last 10)", "entropy/seq_mean"), ("train acc (last 10)", "reward/acc")):
        diffs = [last10(written["kl_cov"][s], key) - last10(written["grpo"][s], key) for s in (1, 2, 3)]
        mean, low, high = by_hand(diffs, (-math.inf, math.inf) if key == "entropy/seq_mean" else (-1, 1))
        difference, interval, pairs, verdict, t_p, sign_p, wilcoxon_p, power, needed = by_metric[metric]
        assert float(difference) == pytest.approx(mean, abs=6e-4) and pairs == "3"
        assert numbers(interval) == pytest.approx([low, high], abs=6e-4)
        assert verdict == ("excludes 0" if low > 0 or high < 0 else "not significant at 3 seeds")
        # the p-values beside the interval: scipy's t-test and Wilcoxon, the sign test exact (3 pairs: at least 0.25)
        assert float(t_p) == pytest.approx(ttest_1samp(diffs, 0).pvalue, abs=6e-4)
        assert float(wilcoxon_p) == pytest.approx(wilcoxon(diffs).pvalue, abs=6e-4)
        positives = sum(d > 0 for d in diffs)
        assert float(sign_p) == pytest.approx(binomtest(positives, 3, 0.5).pvalue, abs=6e-4)
        # power at the observed effect, by the noncentral t: more pairs needed when it is under 80%
        assert 0 <= float(power) <= 1 and (int(needed) > 3) == (float(power) < 0.8)
    # KL-Cov's covariance is 0.02 lower every step, so its entropy ends about 0.4 higher: clearly significant
    assert by_metric["entropy (last 10)"][3] == "excludes 0"
    # the same train accuracy by construction (noise only): its interval holds 0
    assert by_metric["train acc (last 10)"][3] == "not significant at 3 seeds"
    assert {f"pass@{k}" for k in STUDY_KS} <= set(by_metric)


def test_paired_difference_and_mean_interval_directly():
    est = mean_interval([0.2, 0.3, 0.4])
    # s = 0.1 exactly, so the half-width is t(2) 0.1 / sqrt(3)
    assert est.mean == pytest.approx(0.3) and est.n == 3
    assert est.high - est.mean == pytest.approx(T95_2DF * 0.1 / math.sqrt(3), rel=1e-5)
    assert mean_interval([0.5]) == (0.5, None, None, 1, None, None)  # one seed: no interval
    # cut to the quantity's range: the half-width here is 4.3 * 0.5 / sqrt(3) = 1.24; the uncut bounds are kept
    cut = mean_interval([0.0, 0.5, 1.0], (0.0, 1.0))
    half = T95_2DF * 0.5 / math.sqrt(3)
    assert (cut.low, cut.high, cut.n) == (0.0, 1.0, 3) and cut.low_cut and cut.high_cut
    assert (cut.low_uncut, cut.high_uncut) == pytest.approx((0.5 - half, 0.5 + half), rel=1e-5)
    assert not est.low_cut and not est.high_cut and est.low == est.low_uncut
    # seed 4 has no baseline run: two pairs, differences 0.1 and 0.3
    d = paired_difference({"seed1": 0.5, "seed2": 0.7, "seed4": 9.0}, {"seed1": 0.4, "seed2": 0.4})
    assert d.n == 2 and d.mean == pytest.approx(0.2)
    assert d.high - d.mean == pytest.approx(12.706205 * statistics.stdev([0.1, 0.3]) / math.sqrt(2), rel=1e-5)
    assert paired_difference({"seed1": 0.5}, {"seed2": 0.4}) is None


def test_t95_matches_a_printed_t_table():
    # two-sided 95% quantiles of Student's t from a printed table, by degrees of freedom
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 6: 2.447, 10: 2.228, 30: 2.042, math.inf: 1.960}
    for df, value in table.items():
        assert t95(df) == pytest.approx(value, abs=1e-3)
    assert t95(6) == pytest.approx(student_t.ppf(0.975, 6), rel=1e-12)


def test_mechanism_pairs_each_steps_covariance_with_the_next_entropy_change(tmp_path):
    # hand-made: entropy at steps 0..5, covariance at 0..5; step 3 lacks entropy, so t = 2 and t = 3 drop out
    hs = {0: 0.70, 1: 0.66, 2: 0.65, 4: 0.55, 5: 0.52}
    covs = {0: 0.03, 1: 0.02, 2: 0.05, 3: 0.01, 4: 0.04, 5: 0.00}
    records = [{"step": s, "cov/mean": covs[s], **({"entropy/seq_mean": hs[s]} if s in hs else {})} for s in covs]
    run = parse_run(f"x={write_run_folder(tmp_path / 'x', records)}").runs[0]
    x, y, level = cov_entropy_points(run)
    assert x.tolist() == [0.03, 0.02, 0.04]  # t = 0, 1, 4 (t = 5 has no step 6)
    assert y == pytest.approx([0.66 - 0.70, 0.65 - 0.66, 0.52 - 0.55])
    assert level.tolist() == [0.70, 0.66, 0.55]  # entropy at t itself, which the partial r holds fixed


def test_pearson_and_its_fisher_interval_by_hand():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 0.02, 60)
    y = -1.0 * x + rng.normal(0, 0.01, 60)
    c = pearson_interval(x, y)
    # Pearson by its definition, the interval by Fisher's z with the standard library
    dx, dy = x - x.mean(), y - y.mean()
    r = float((dx * dy).sum() / math.sqrt((dx**2).sum() * (dy**2).sum()))
    z, se = math.atanh(r), 1 / math.sqrt(60 - 3)
    assert c.n == 60 and c.r == pytest.approx(r, abs=1e-12)
    assert (c.low, c.high) == pytest.approx((math.tanh(z - Z975 * se), math.tanh(z + Z975 * se)), abs=1e-6)
    assert c.r < 0 and c.high < 0
    assert pearson_interval(x[:3], y[:3]) is None  # Fisher's interval needs n > 3
    assert pearson_interval(np.ones(10), y[:10]) is None  # no spread: no correlation
    assert pearson_interval([1, 2, 3, 4], [2, 4, 6, 8]).r == pytest.approx(1.0)  # finite, at the bound


def test_mechanism_is_printed_over_all_runs_and_recovers_the_sign(tmp_path, capsys):
    written = write_study(tmp_path, STUDY)
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "p")
    assert code == 0, err
    rows = markdown_rows(out, "| runs | points |")
    xs, ys = [], []
    for seeds in written.values():
        for recs in seeds.values():
            xs += [r["cov/mean"] for r in recs[:-1]]
            ys += [b["entropy/seq_mean"] - a["entropy/seq_mean"] for a, b in zip(recs, recs[1:])]
    r = float(np.corrcoef(xs, ys)[0, 1])
    half = Z975 / math.sqrt(len(xs) - 3)
    points, shown_r, interval, boot, shown_partial, partial_fisher, partial_boot, n_runs = rows["all"]
    assert int(points) == len(xs) == 3 * 3 * 24 and n_runs == "9"
    assert float(shown_r) == pytest.approx(r, abs=6e-4) and r < -0.5  # entropy follows minus the covariance
    fisher = [math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)]
    assert numbers(interval) == pytest.approx(fisher, abs=6e-4)
    # the partial r given entropy[t], by the closed form from the three pairwise correlations
    zs = [r["entropy/seq_mean"] for seeds in written.values() for recs in seeds.values() for r in recs[:-1]]
    r_xz, r_yz = np.corrcoef(xs, zs)[0, 1], np.corrcoef(ys, zs)[0, 1]
    partial = (r - r_xz * r_yz) / math.sqrt((1 - r_xz**2) * (1 - r_yz**2))
    assert float(shown_partial) == pytest.approx(partial, abs=6e-4)
    half = Z975 / math.sqrt(len(xs) - 4)
    fisher = [math.tanh(math.atanh(partial) - half), math.tanh(math.atanh(partial) + half)]
    assert numbers(partial_fisher) == pytest.approx(fisher, abs=6e-4)
    # the run-level bootstrap over nine runs is printed and holds its r; three runs alone are too few for one
    for cell, value in ((boot, r), (partial_boot, partial)):
        low, high = numbers(cell)
        assert low < value < high
    assert rows["grpo"][3] == rows["grpo"][6] == "n/a" and rows["grpo"][7] == "3"
    assert set(rows) == {"all", *STUDY}
    assert_png(tmp_path / "p" / "cov_entropy.png")


def test_pass_at_k_curves_use_the_last_evaluation_of_each_run(tmp_path):
    written = write_study(tmp_path, {"grpo": 0.02, "kl_cov": 0.0}, seeds=(1, 2))
    methods = group_methods([parse_run(spec) for spec in study_specs(tmp_path, written)])
    curves = pass_at_k_curves(methods)
    for method, seeds in written.items():
        assert [k for k, _ in curves[method]] == list(STUDY_KS)
        for k, est in curves[method]:
            values = [recs[-1][f"eval/pass@{k}"] for recs in seeds.values()]
            half = 12.706205 * statistics.stdev(values) / math.sqrt(2)
            assert est.n == 2 and est.mean == pytest.approx(statistics.mean(values))
            assert (est.low, est.high) == pytest.approx((est.mean - half, est.mean + half), rel=1e-5)
        # the midway evaluation logged pass@k too, with other values: the curve is not from there
        assert curves[method][0][1].mean != pytest.approx(statistics.mean(r[20]["eval/pass@1"] for r in seeds.values()))


def test_a_run_without_pass_at_k_is_skipped_with_a_note(tmp_path, capsys):
    written = write_study(tmp_path, {"grpo": 0.02}, seeds=(1, 2))
    old = tmp_path / "grpo_seed3"
    old.mkdir()
    records = study_records(0.02, seed=7, with_pass=False)  # a run from before pass@k: held-out accuracy only
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    specs = [*study_specs(tmp_path, written), f"grpo={old}"]
    code, out, err = run_main(capsys, *specs, "--out", tmp_path / "p")
    assert code == 0, err
    assert "grpo_seed3: no eval/pass@k logged: left out of pass@k" in out
    assert out.count("no eval/pass@k") == 1  # the plot and the table both look: one note
    assert markdown_rows(out, "| method | runs |")["grpo"][0] == "2"  # pass@k over the two seeds that have it
    assert markdown_rows(out, "| method | seeds |")["grpo"][0] == "3"  # everything else over all three
    assert_png(tmp_path / "p" / "pass_at_k.png")


def test_a_run_without_its_final_evaluation_is_kept_with_a_note(tmp_path, capsys):
    written = write_study(tmp_path, {"grpo": 0.02}, seeds=(1, 2))
    path = tmp_path / "grpo_seed2" / "metrics.jsonl"
    records = written["grpo"][2]
    records[-1] = {k: v for k, v in records[-1].items() if not k.startswith("eval/")}  # the final eval never ran
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "p")
    assert code == 0, err
    assert "grpo_seed2: its last pass@k is from step 20 of 24: not the final weights" in out
    cell = markdown_rows(out, "| method | runs |")["grpo"][1]  # pass@1 of seed 1's final row and seed 2's step 20
    values = [written["grpo"][1][-1]["eval/pass@1"], records[20]["eval/pass@1"]]
    assert numbers(cell)[0] == pytest.approx(statistics.mean(values), abs=6e-4)


def test_seeds_of_different_lengths_are_fine(tmp_path, capsys):
    written = write_study(tmp_path, {"grpo": 0.02}, seeds=(1, 2))
    short = tmp_path / "grpo_seed3"
    short.mkdir()
    records = study_records(0.02, seed=9, n=20)  # a run stopped at step 20 (its own final evaluation at 19)
    (short / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    specs = [*study_specs(tmp_path, written), f"grpo={short}"]
    code, out, err = run_main(capsys, *specs, "--out", tmp_path / "p")
    assert code == 0, err
    row = markdown_rows(out, "| method | seeds |")["grpo"]
    assert row[:2] == ["3", "20-25"]
    entropy = [
        statistics.mean(r["entropy/seq_mean"] for r in recs[-10:]) for recs in [*written["grpo"].values(), records]
    ]
    assert numbers(row[2]) == pytest.approx(by_hand(entropy, (0, math.inf)), abs=6e-4)  # each seed's own last 10 steps
    assert "its runs have 25, 25, 20 steps" in out
    assert "method - grpo" not in out  # only the baseline: nothing to compare
    # the curve: steps 20-24 average the two long seeds only
    steps, mean, low, high = across_runs([(np.arange(3.0), np.array([1.0, 2, 3])), (np.arange(2.0), np.zeros(2))])
    assert steps.tolist() == [0, 1, 2] and mean.tolist() == [0.5, 1.0, 3.0]
    assert low.tolist() == [0, 0, 3] and high.tolist() == [1, 2, 3]


def test_seeds_pair_by_number_else_by_order(tmp_path):
    folders = [write_run_folder(tmp_path / name, synthetic_records(*METHODS["grpo"])) for name in ("a", "b")]
    methods = group_methods([parse_run(f"m={f}") for f in folders])
    assert len(methods) == 1 and [r.seed for r in methods[0].runs] == ["run1", "run2"]
    study = write_study(tmp_path / "s", {"grpo": 0.02, "kl_cov": 0.0}, seeds=(2, 10))
    specs = study_specs(tmp_path / "s", study)
    methods = group_methods([parse_run(s) for s in specs])
    assert [[r.seed for r in m.runs] for m in methods] == [["seed2", "seed10"], ["seed2", "seed10"]]
    # one method without numbers: all pair by order, so that "else by order" holds across methods
    methods = group_methods([parse_run(s) for s in specs] + [parse_run(f"m={f}") for f in folders])
    assert [[r.seed for r in m.runs] for m in methods] == [["run1", "run2"]] * 3


def test_one_seed_pair_has_no_interval(tmp_path, capsys):
    grpo = write_study(tmp_path, {"grpo": 0.02}, seeds=(1, 2))
    kl = write_study(tmp_path, {"kl_cov": 0.0}, seeds=(1,))
    code, out, err = run_main(capsys, *study_specs(tmp_path, grpo), *study_specs(tmp_path, kl), "--out", tmp_path / "p")
    assert code == 0, err
    rows = {cells[0]: cells[1:] for cells in markdown_rows(out, "| method - grpo |")["kl_cov"]}
    difference, interval, pairs, verdict, *tests = rows["entropy (last 10)"]
    assert tests == ["n/a"] * 5  # no p-value, power or pairs needed from one pair
    last10 = [statistics.mean(r["entropy/seq_mean"] for r in recs[-10:]) for recs in (kl["kl_cov"][1], grpo["grpo"][1])]
    assert float(difference) == pytest.approx(last10[0] - last10[1], abs=6e-4)  # seed 1 against seed 1 only
    assert (interval, pairs, verdict) == ("n/a", "1", "one seed pair: no interval")
    assert markdown_rows(out, "| method | seeds |")["kl_cov"][:3] == ["1", "25", f"{last10[0]:.3f}"]


def test_knob_trajectories_are_drawn_only_for_runs_whose_controller_moved(tmp_path, capsys):
    written = write_study(tmp_path / "runs", {"grpo": 0.02, "kl_cov_band": 0.0}, seeds=(1, 2))
    # the trainer logs the controller's knobs every step; switched off they stay at scale 1 and bonus 0
    for method, moved in (("grpo", False), ("kl_cov_band", True)):
        for seed, records in written[method].items():
            for rec in records:
                rec["entropy_ctl/scale"] = 1.0 + (0.1 * rec["step"] if moved else 0.0)
                rec["entropy_ctl/bonus"] = 0.001 * seed if moved else 0.0
            path = tmp_path / "runs" / f"{method}_seed{seed}" / "metrics.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
    methods = group_methods([parse_run(spec) for spec in study_specs(tmp_path / "runs", written)])
    assert [controller_moved(m) for m in methods] == [False, True]
    code, _, _ = run_main(capsys, *study_specs(tmp_path / "runs", written), "--out", tmp_path / "plots")
    assert code == 0
    assert_png(tmp_path / "plots" / "knobs.png")
    # without a controller that moved, no knob figure
    only_grpo = [s for s in study_specs(tmp_path / "runs", written) if s.startswith("grpo=")]
    code, _, _ = run_main(capsys, *only_grpo, "--out", tmp_path / "plots_grpo")
    assert code == 0 and not (tmp_path / "plots_grpo" / "knobs.png").exists()


def test_band_ceiling_recovers_the_noise_of_a_synthetic_reading(tmp_path):
    rng = np.random.default_rng(0)
    sigma, n = 0.2, 4000
    readings = 0.65 + rng.normal(0, sigma, n)  # true entropy at the band's centre, white noise on each reading
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "entropy/seq_mean": float(h)}) + "\n"
                                                  for i, h in enumerate(readings)))  # fmt: skip
    got_sigma, best = band_ceiling(Run(folder), (0.5, 0.8))
    assert got_sigma == pytest.approx(sigma, rel=0.05)
    # the share of readings inside the band is what the normal model predicts from that sigma
    measured = float(np.mean((readings >= 0.5) & (readings <= 0.8)))
    assert best == pytest.approx(measured, abs=0.03) and best == pytest.approx(
        math.erf(0.15 / (sigma * 2**0.5)), abs=0.02
    )
    assert band_ceiling(Run(folder), (0.5, 0.8), from_step=n - 2) is None  # too few readings


def test_per_seed_table_shows_each_run_against_the_baseline_of_its_seed(tmp_path, capsys):
    written = write_study(tmp_path, STUDY)
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "p", "--band", "0.5,0.8")
    assert code == 0, err
    head = next(line for line in out.splitlines() if line.startswith("| seed |"))
    assert head == (
        "| seed | method | entropy (last 10) | entropy / grpo (same seed) | pass@1 | pass@16 "
        "| in [0.5, 0.8] (step >= 5) |"
    )
    rows = markdown_rows(out, "| seed |")
    assert sorted(rows) == ["1", "2", "3"]
    for seed, seed_rows in rows.items():
        assert [r[0] for r in seed_rows] == list(STUDY)  # every method, in command-line order
        recs = {method: written[method][int(seed)] for method in STUDY}
        grpo_h = statistics.mean(r["entropy/seq_mean"] for r in recs["grpo"][-10:])
        for method, entropy, ratio, pass1, pass16, band in seed_rows:
            h = statistics.mean(r["entropy/seq_mean"] for r in recs[method][-10:])
            assert float(entropy) == pytest.approx(h, abs=6e-4)
            assert float(ratio) == pytest.approx(h / grpo_h, abs=6e-3)  # against the same seed's, not the mean
            assert float(pass1) == pytest.approx(recs[method][-1]["eval/pass@1"], abs=6e-4)
            assert float(pass16) == pytest.approx(recs[method][-1]["eval/pass@16"], abs=6e-4)
            share = statistics.mean(0.5 <= r["entropy/seq_mean"] <= 0.8 for r in recs[method][5:])
            assert float(band.rstrip("%")) == pytest.approx(100 * share, abs=0.6)


def test_selection_table_gives_each_runs_selected_share_of_tokens_and_of_its_candidates(tmp_path, capsys):
    written = write_study(tmp_path, {"grpo": 0.02, "clip_cov": 0.015, "kl_cov": 0.0}, seeds=(1, 2))
    rng = np.random.default_rng(7)
    logged = {}  # (method, seed) -> what the selection rows hold, per step
    for method, key in (("clip_cov", "loss/clip_cov_frac"), ("kl_cov", "loss/kl_cov_frac")):
        for seed, records in written[method].items():
            selected = rng.uniform(0.0, 0.04, len(records))
            inside = selected + rng.uniform(0.0, 0.06, len(records))
            starved = (rng.uniform(size=len(records)) < 0.4).astype(float)
            for rec, s, i, z in zip(records, selected, inside, starved):
                rec[key], rec["loss/select_starved"] = float(s), float(z)
                if method == "clip_cov":
                    rec["loss/clip_cov_in_bounds"] = float(i)
            (tmp_path / f"{method}_seed{seed}" / "metrics.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in records)
            )
            logged[method, seed] = (selected, inside, starved)
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "plots")
    assert code == 0, err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| seed | method | tokens selected"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        seed, method, *cells = (c.strip() for c in line.split("|")[1:-1])
        rows[method, int(seed)] = cells
    assert set(rows) == set(logged)  # GRPO selects nothing: no row
    for (method, seed), (selected, inside, starved) in logged.items():
        cells = rows[method, seed]
        assert cells[0] == f"{100 * sum(selected) / len(selected):.2f}%"
        assert cells[3] == f"{100 * sum(starved) / len(starved):.0f}%"
        if method == "clip_cov":  # the selected share of the candidates is the ratio of the two means
            assert cells[1] == f"{100 * sum(inside) / len(inside):.2f}%"
            assert cells[2] == f"{100 * sum(selected) / sum(inside):.0f}%"
        else:  # KL-Cov has no bounds
            assert cells[1:3] == ["n/a", "n/a"]


def holm_by_hand(ps: list[float]) -> list[float]:
    """Holm's adjusted p-values written out: sort, multiply the i-th smallest (from 0) by m - i, keep non-decreasing."""
    order = sorted(range(len(ps)), key=ps.__getitem__)
    adjusted, running = [0.0] * len(ps), 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (len(ps) - i) * ps[j]))
        adjusted[j] = running
    return adjusted


def test_holm_lists_every_paired_test_and_a_named_family_alone(tmp_path, capsys):
    written = write_study(tmp_path, STUDY)
    specs = study_specs(tmp_path, written)
    family = "kl_cov:train_acc,kl_cov:pass@*"
    code, out, err = run_main(capsys, *specs, "--out", tmp_path / "p", "--family", family)
    assert code == 0, err
    paired = {}  # (method, metric) -> the t-test's p as the paired table prints it
    for method, rows in markdown_rows(out, "| method - grpo |").items():
        for metric, *cells in rows:
            paired[method, metric] = float(cells[4])
    lines = out.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("Holm's correction over")]
    assert len(heads) == 2 and "every paired t-test above" in lines[heads[0]] and family in lines[heads[1]]

    def holm_rows(start: int) -> list[list[str]]:
        rows = []
        for line in lines[start + 3 :]:
            if not line.startswith("| "):
                break
            rows.append([c.strip() for c in line.split("|")[1:-1]])
        return rows

    everything = holm_rows(heads[0])
    # the whole family: every row of the paired table (two methods x 9 metrics: entropy, its log ratio, train and
    # test accuracy, pass@1-16), in its order, with the same raw p
    assert [(r[0], r[1]) for r in everything] == list(paired) and len(everything) == 2 * 9
    raw = [paired[r[0], r[1]] for r in everything]
    assert [float(r[2]) for r in everything] == raw
    for row, adjusted in zip(everything, holm_by_hand(raw)):  # p printed to 3 significant digits
        assert float(row[3]) == pytest.approx(adjusted, rel=0.01)
        assert row[4] == ("survives" if float(row[3]) <= 0.05 else "does not survive")
    named = holm_rows(heads[1])
    assert [r[1] for r in named] == ["train acc (last 10)", *(f"pass@{k}" for k in STUDY_KS)]
    raw = [paired["kl_cov", r[1]] for r in named]
    assert [float(r[3]) for r in named] == pytest.approx(holm_by_hand(raw), rel=0.01)


@pytest.mark.parametrize("family", ["kl_cov:train_ac", "train_acc", "nobody:*"])
def test_a_family_naming_no_test_fails_with_one_line(tmp_path, capsys, family):
    written = write_study(tmp_path, {"grpo": 0.02, "kl_cov": 0.0})
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "p", "--family", family)
    assert code == 2 and out == ""
    assert f"--family {family}" in err and "kl_cov:train_acc" in err and err.count("\n") == 1


def test_the_entropy_log_ratio_is_tested_paired_by_seed(tmp_path, capsys):
    written = write_study(tmp_path, {"grpo": 0.02, "kl_cov": 0.0}, seeds=(1, 2, 3, 4, 5))
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "p")
    assert code == 0, err
    rows = {cells[0]: cells[1:] for cells in markdown_rows(out, "| method - grpo |")["kl_cov"]}
    difference, interval, pairs, _, t_p, sign_p, wilcoxon_p, _, _ = rows["ln(entropy / grpo) (last 10)"]
    logs = [
        math.log(statistics.mean(r["entropy/seq_mean"] for r in written["kl_cov"][s][-10:]))
        - math.log(statistics.mean(r["entropy/seq_mean"] for r in written["grpo"][s][-10:]))
        for s in range(1, 6)
    ]
    mean, sd = statistics.mean(logs), statistics.stdev(logs)
    half = student_t.ppf(0.975, 4) * sd / math.sqrt(5)
    assert pairs == "5" and float(difference) == pytest.approx(mean, abs=6e-4)
    assert numbers(interval) == pytest.approx([mean - half, mean + half], abs=6e-4)
    assert float(t_p) == pytest.approx(ttest_1samp(logs, 0).pvalue, rel=0.01)
    assert float(sign_p) == pytest.approx(binomtest(sum(v > 0 for v in logs), 5).pvalue, abs=6e-4)
    assert float(wilcoxon_p) == pytest.approx(wilcoxon(logs).pvalue, abs=6e-4)


def test_a_bound_cut_to_the_range_is_marked_and_the_uncut_one_given(tmp_path, capsys):
    # three seeds whose held-out accuracy spreads so far that the t-interval passes 0: 0.02, 0.30, 0.05
    written = write_study(tmp_path, {"grpo": 0.02})
    for seed, acc in zip((1, 2, 3), (0.02, 0.30, 0.05)):
        records = written["grpo"][seed]
        records[-1]["eval/acc"] = acc
        (tmp_path / f"grpo_seed{seed}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_main(capsys, *study_specs(tmp_path, written), "--out", tmp_path / "p")
    assert code == 0, err
    test_acc = markdown_rows(out, "| method | seeds |")["grpo"][5]
    mean, sd = statistics.mean([0.02, 0.30, 0.05]), statistics.stdev([0.02, 0.30, 0.05])
    low, high = mean - T95_2DF * sd / math.sqrt(3), mean + T95_2DF * sd / math.sqrt(3)
    assert low < 0 and test_acc == f"{mean:.3f} [0.000*, {high:.3f}]"
    footnote = next(line for line in out.splitlines() if line.startswith("* cut to the range"))
    assert f"grpo test acc [{low:.3f}, {high:.3f}]" in footnote
