"""The benchmarks run against the real trainer and actors, so they break when those change: each quick mode must
still measure (exit 0, headline as the last line). The figures themselves are not asserted beyond sanity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def benchmark_stdout(name: str, *args: str, timeout: int = 900) -> str:
    """What the script printed, once it exited 0."""
    # its own local Ray, not the test session's
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ID")} | {"TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
    )  # fmt: skip
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{output}"
    return result.stdout


def headline(stdout: str) -> tuple[str, float]:
    key, _, value = stdout.strip().splitlines()[-1].partition(": ")
    return key, float(value)


def run_benchmark(name: str, *args: str, timeout: int = 900) -> tuple[str, float]:
    return headline(benchmark_stdout(name, *args, timeout=timeout))


def test_overlap_async_beats_sync():
    key, efficiency = run_benchmark("overlap", "--steps", "3")
    assert key == "overlap_efficiency"
    # the bound is 1.43 for both settings: an efficiency above 0.75 means async was faster than sync
    assert 0.75 < efficiency <= 1.05


def test_prefix_sharing_measures_all_three_modes():
    key, speedup = run_benchmark("prefix_sharing", "--model", "tiny", "--repeats", "1", "--shapes", "demo")
    assert key == "prefix_sharing_step_speedup" and speedup > 0


def test_bypass_times_both_paths_on_the_same_batch():
    key, ratio = run_benchmark(
        "bypass", "--samples", "8", "--prompt-len", "32", "--response-len", "16", "--repeats", "1"
    )
    assert key == "bypass_step_ratio" and ratio > 0


def test_loss_overhead_measures_every_registered_objective():
    """The step table runs every objective of the registry (both scopes where it selects) through the real actor."""
    key, ratio = run_benchmark(
        "loss_overhead", "--model", "tiny", "--samples", "8", "--repeats", "1", "--loss-repeats", "2"
    )
    assert key == "loss_overhead_max_ratio" and ratio > 0


def test_long_responses_twin_runs_the_trainer_step_at_each_length_with_each_head():
    """The CPU twin of the GPU memory benchmark: the trainer's step at each length, cut by the token budget, with the
    whole output head and in chunks. With a 16-token prompt and a budget of 120, responses of 32 go two to a
    micro-batch (48 + 48) and responses of 96 one (112), so 4 responses make 2 and then 4 micro-batches of 64 and 96
    response tokens at most."""
    out = benchmark_stdout(
        "long_responses", "--device", "cpu", "--arch", "tiny", "--lengths", "32,96", "--prompt-len", "16",
        "--budget", "120", "--head-chunks", "0,16",
    )  # fmt: skip
    table = [line.split() for line in out.splitlines()]
    rows = {(int(f[0]), int(f[1])): (int(f[2]), int(f[3])) for f in table if f and f[0].isdigit()}
    assert rows == {(32, 0): (2, 64), (32, 16): (2, 64), (96, 0): (4, 96), (96, 16): (4, 96)}, out
    key, peak = headline(out)
    assert key == "long_responses_peak_gib" and peak > 0
