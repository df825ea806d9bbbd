"""The empirical law R = -a exp(H) + b: fitting, forecasting, reading runs, and the command-line script."""

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from entropy_openrlhf.algorithms.entropy_law import (
    EntropyLawFit,
    fit_entropy_law,
    forecast,
    read_csv,
    read_wandb_offline,
)

ROOT = Path(__file__).resolve().parents[2]
A, B = 0.4, 0.9  # ceiling b - a = 0.5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_run(n=80, noise=0.003, seed=0):
    """Entropy falling from 1.5 to 0.05 (fast first, as in the paper's runs) and accuracy on the law plus noise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    h = 0.05 + 1.45 * np.exp(-steps / 15.0)
    r = -A * np.exp(h) + B + rng.normal(0.0, noise, n)
    return steps, h, r


# ---------------------------------------------------------------- fit


def test_fit_is_exact_on_noise_free_points():
    h = np.linspace(0.05, 1.5, 12)
    r = -A * np.exp(h) + B
    law = fit_entropy_law(h, r)
    assert law.a == pytest.approx(A, abs=1e-6)
    assert law.b == pytest.approx(B, abs=1e-6)
    assert law.ceiling == pytest.approx(B - A, abs=1e-6)
    assert law.rmse < 1e-6
    assert law.n_points == 12
    # predict: at H = 0 the ceiling; at H = 1, 0.9 - 0.4 e = -0.18731273
    assert law.predict(0.0) == pytest.approx(0.5, abs=1e-6)
    assert law.predict(1.0) == pytest.approx(0.9 - 0.4 * math.e, abs=1e-6)
    np.testing.assert_allclose(law.predict(np.array([0.0, 1.0])), [0.5, 0.9 - 0.4 * math.e], atol=1e-6)


def test_fit_recovers_a_and_b_from_noisy_run():
    _, h, r = synthetic_run()
    law = fit_entropy_law(h, r)
    assert law.a == pytest.approx(A, abs=0.005)
    assert law.b == pytest.approx(B, abs=0.005)
    assert law.ceiling == pytest.approx(0.5, abs=0.005)
    # the residual RMSE is the noise level (0.003), independently recomputed here
    resid = r - (-law.a * np.exp(h) + law.b)
    assert law.rmse == pytest.approx(float(np.sqrt(np.mean(resid**2))), rel=1e-9)
    assert 0.002 < law.rmse < 0.004


def test_fit_is_least_squares():
    # the closed form of the linear least-squares problem in (a, b), solved independently with the normal equations
    _, h, r = synthetic_run(n=30, noise=0.02, seed=3)
    x = -np.exp(h)
    n, sx, sy, sxx, sxy = len(x), x.sum(), r.sum(), (x * x).sum(), (x * r).sum()
    a = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    b = (sy - a * sx) / n
    law = fit_entropy_law(h, r)
    assert law.a == pytest.approx(a, rel=1e-6)
    assert law.b == pytest.approx(b, rel=1e-6)


def test_fit_drops_non_finite_points_and_needs_two():
    h = np.array([0.1, np.nan, 0.5, 1.0])
    r = -A * np.exp(np.array([0.1, 0.3, 0.5, 1.0])) + B
    r[3] = np.inf
    law = fit_entropy_law(h, r)  # two finite points left: 0.1 and 0.5, an exact fit
    assert law.n_points == 2
    assert (law.a, law.b) == (pytest.approx(A, abs=1e-6), pytest.approx(B, abs=1e-6))
    with pytest.raises(ValueError, match="at least 2 finite"):
        fit_entropy_law(np.array([0.5]), np.array([0.3]))
    with pytest.raises(ValueError, match="got 1"):
        fit_entropy_law(np.array([0.5, np.nan]), np.array([0.3, 0.2]))
    with pytest.raises(ValueError, match="got 0"):
        fit_entropy_law(np.array([]), np.array([]))


def test_fit_with_two_points_is_exact_and_silent():
    import warnings

    h = np.array([0.2, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy's "covariance could not be estimated" must not reach the user
        law = fit_entropy_law(h, -A * np.exp(h) + B)
    assert law.a == pytest.approx(A, abs=1e-6) and law.b == pytest.approx(B, abs=1e-6)


def test_fit_with_a_single_entropy_value_is_an_error():
    # R = -a e^H + b at one H only fixes b - a e^H: any a fits, so refuse instead of returning arbitrary numbers
    with pytest.raises(ValueError, match="same entropy 0.5"):
        fit_entropy_law(np.array([0.5, 0.5, 0.5]), np.array([0.3, 0.4, 0.35]))


# ---------------------------------------------------------------- forecast


def test_forecast_from_an_early_prefix():
    _, h, r = synthetic_run()
    fc = forecast(h, r, 15)  # the first 15 of 80 points: entropy still above 0.45
    assert h[14] > 0.45 and h[-1] < 0.06
    prefix = fit_entropy_law(h[:15], r[:15])
    assert fc["a"] == pytest.approx(prefix.a) and fc["b"] == pytest.approx(prefix.b)
    assert fc["ceiling"] == pytest.approx(prefix.b - prefix.a)
    assert fc["fit_rmse"] == pytest.approx(prefix.rmse)
    pred = -prefix.a * np.exp(h[15:]) + prefix.b
    assert fc["forecast_rmse"] == pytest.approx(float(np.sqrt(np.mean((pred - r[15:]) ** 2))), rel=1e-9)
    assert fc["forecast_rmse"] < 0.008  # about the noise level: the law extrapolates
    assert fc["final_actual"] == r[-1]
    assert fc["final_predicted"] == pytest.approx(-A * math.exp(h[-1]) + B, abs=0.01)


@pytest.mark.parametrize("fit_points", [0, 1, 80, 81])
def test_forecast_rejects_bad_fit_points(fit_points):
    _, h, r = synthetic_run()
    with pytest.raises(ValueError, match=rf"fit_points={fit_points} must be at least 2 and less than the 80"):
        forecast(h, r, fit_points)


# ---------------------------------------------------------------- readers


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def test_read_csv_skips_blanks_and_sorts_by_step(tmp_path):
    path = tmp_path / "run.csv"
    write_csv(
        path,
        ["step", "entropy/seq_mean", "eval/acc", "loss"],
        [
            [30, 0.3, 0.55, 1.0],
            [10, 0.9, 0.30, 1.0],
            [20, "", 0.40, 1.0],  # accuracy logged, entropy not: skipped
            [0, 1.2, 0.20, 1.0],
            [40, 0.1, "", 1.0],  # skipped
            [25, 0.5, 0.50, ""],  # a blank in another column does not matter
            [5, "n/a", 0.25, 1.0],  # not a number: skipped
        ],
    )
    h, r = read_csv(path, "entropy/seq_mean", "eval/acc")
    assert h.tolist() == [1.2, 0.9, 0.5, 0.3]  # steps 0, 10, 25, 30
    assert r.tolist() == [0.20, 0.30, 0.50, 0.55]


def test_read_csv_without_step_keeps_file_order(tmp_path):
    path = tmp_path / "run.csv"
    write_csv(path, ["H", "R"], [[0.9, 0.1], [0.2, 0.5], [0.5, 0.3]])
    h, r = read_csv(path, "H", "R")
    assert h.tolist() == [0.9, 0.2, 0.5] and r.tolist() == [0.1, 0.5, 0.3]


def test_read_csv_missing_column_names_it(tmp_path):
    path = tmp_path / "run.csv"
    write_csv(path, ["step", "entropy/seq_mean", "eval/accuracy"], [[0, 1.0, 0.2]])
    with pytest.raises(ValueError, match=r"no column 'eval/acc'.*eval/accuracy"):
        read_csv(path, "entropy/seq_mean", "eval/acc")
    with pytest.raises(ValueError, match=r"no column 'entropy'"):
        read_csv(path, "entropy", "eval/accuracy")


def test_read_csv_without_usable_rows(tmp_path):
    path = tmp_path / "run.csv"
    write_csv(path, ["step", "H", "R"], [[0, "", 0.2], [1, 0.5, ""]])
    with pytest.raises(ValueError, match="no rows hold both"):
        read_csv(path, "H", "R")


def test_read_wandb_offline(tmp_path):
    # a W&B offline folder of a run from before metrics.jsonl moved to the output folder: still read
    run = tmp_path / "offline-run-20260101_000000-abc"
    (run / "files").mkdir(parents=True)
    records = [
        {"step": 8, "entropy/seq_mean": 0.4, "eval/acc": 0.45, "loss/policy": 0.1},
        {"step": 1, "entropy/seq_mean": 1.1, "loss/policy": 0.2},  # no accuracy at this step: skipped
        {"step": 0, "entropy/seq_mean": 1.3, "eval/acc": 0.21},
        {"step": 4, "entropy/seq_mean": 0.7, "eval/acc": 0.33},
        {"step": 6, "eval/acc": 0.40},  # no entropy: skipped
    ]
    lines = [json.dumps(x) for x in records]
    lines.insert(2, "")  # blank lines are tolerated
    (run / "files" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    h, r = read_wandb_offline(run, "entropy/seq_mean", "eval/acc")
    assert h.tolist() == [1.3, 0.7, 0.4]
    assert r.tolist() == [0.21, 0.33, 0.45]
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_wandb_offline(tmp_path / "nothing-here", "entropy/seq_mean", "eval/acc")
    with pytest.raises(ValueError, match="no rows hold both"):
        read_wandb_offline(run, "entropy/seq_mean", "eval/pass@1")


# ---------------------------------------------------------------- the script


def run_script(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fit_entropy_law.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def printed(stdout, key):
    m = re.search(rf"^{re.escape(key)}: (\S+)$", stdout, re.M)
    assert m, f"{key!r} not printed in:\n{stdout}"
    return float(m.group(1))


def test_script_fits_a_csv_and_writes_a_png(tmp_path):
    steps, h, r = synthetic_run()
    path = tmp_path / "run.csv"
    write_csv(path, ["step", "entropy/seq_mean", "eval/acc"], [[int(s), x, y] for s, x, y in zip(steps, h, r)])
    png = tmp_path / "fit.png"
    proc = run_script(path, "--plot", png, "--forecast-from", 15)
    assert proc.returncode == 0, proc.stderr
    law = fit_entropy_law(h, r)
    assert printed(proc.stdout, "points") == 80
    assert printed(proc.stdout, "a") == pytest.approx(A, abs=0.005)
    assert printed(proc.stdout, "b") == pytest.approx(B, abs=0.005)
    assert printed(proc.stdout, "a") == pytest.approx(law.a, rel=1e-5)  # 6 significant digits printed
    assert printed(proc.stdout, "b") == pytest.approx(law.b, rel=1e-5)
    assert printed(proc.stdout, "ceiling (b - a)") == pytest.approx(law.ceiling, rel=1e-5)
    assert "forecast from first 15 points" in proc.stdout
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5000  # a real plot, not an empty image


def test_script_reads_a_runs_output_folder(tmp_path):
    steps, h, r = synthetic_run(n=20)
    (tmp_path / "run").mkdir()
    lines = [json.dumps({"step": int(s), "H": float(x), "R": float(y)}) for s, x, y in zip(steps, h, r)]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines))  # where the trainer writes it
    proc = run_script(tmp_path / "run", "--entropy", "H", "--acc", "R")
    assert proc.returncode == 0, proc.stderr
    law = fit_entropy_law(h, r)
    assert printed(proc.stdout, "a") == pytest.approx(law.a, rel=1e-5)
    assert printed(proc.stdout, "points") == 20


def test_script_missing_column_exits_2_with_a_clear_message(tmp_path):
    path = tmp_path / "run.csv"
    write_csv(path, ["step", "entropy/seq_mean", "accuracy"], [[0, 1.0, 0.2], [1, 0.5, 0.4]])
    proc = run_script(path)
    assert proc.returncode == 2
    assert "no column 'eval/acc'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_script(tmp_path / "absent.csv")
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_fit_dataclass_ceiling():
    assert EntropyLawFit(a=0.25, b=0.75, rmse=0.0, n_points=3).ceiling == 0.5
