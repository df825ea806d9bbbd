"""scripts/plot_runs.py on synthetic runs: the PNGs are written and each method's entropy law is recovered."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "plot_runs.py"
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


def write_run_folder(root: Path, records: list[dict]) -> Path:
    """The layout the trainer leaves: <output_dir>/wandb/offline-run-<time>-<id>/files/metrics.jsonl."""
    run = root / "wandb" / "offline-run-20260101_000000-abc123"
    (run / "files").mkdir(parents=True)
    (run / "files" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def load_module():
    import importlib.util

    if "plot_runs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("plot_runs", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["plot_runs"] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules["plot_runs"]


def run_main(capsys, *args) -> tuple[int, str, str]:
    """The script's main() in this process (the subprocess test above covers the command line itself)."""
    code = load_module().main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} not written"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5_000, f"{path} is not a plausible PNG ({len(data)} bytes)"


def test_writes_every_png_and_recovers_each_methods_law(tmp_path):
    specs = []
    for i, (name, (a, b, tau)) in enumerate(METHODS.items()):
        # the run's output folder: the script finds the single run folder below it
        write_run_folder(tmp_path / name, synthetic_records(a, b, tau, seed=i))
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
    mod = load_module()
    a, b, tau = METHODS["kl_cov"]
    records = synthetic_records(a, b, tau, eval_every=5)
    folder = write_run_folder(tmp_path / "kl", records)
    csv_path = tmp_path / "grpo.csv"
    grpo = synthetic_records(*METHODS["grpo"])
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "entropy/seq_mean", "reward/acc", "time/step"])
        writer.writeheader()
        writer.writerows(grpo)

    runs = [mod.parse_run(f"kl_cov={folder}"), mod.parse_run(str(csv_path))]
    assert runs[1].label == "grpo"  # no label given: the file name
    written = mod.plot_runs(runs, tmp_path / "out")
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
    forced = mod.parse_run(f"kl_cov={folder}")
    mod.fit_run(forced, "reward/acc")
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
