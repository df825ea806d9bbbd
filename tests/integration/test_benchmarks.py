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


def run_benchmark(name: str, *args: str, timeout: int = 900) -> tuple[str, float]:
    # its own local Ray, not the test session's
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ID")} | {"TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
    )  # fmt: skip
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{output}"
    key, _, value = result.stdout.strip().splitlines()[-1].partition(": ")
    return key, float(value)


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
