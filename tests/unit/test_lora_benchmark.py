"""benchmarks/lora.py's figures and table on a synthetic measurement (no run): the step means leave out the first
step, a group no arm has drops its row, and every arm after the first shows its ratio to the first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the scripts import their neighbours
import lora  # noqa: E402 - needs the path above
import memory  # noqa: E402


def fake_measurement(policy_gib: float, step_s: list[float], reference_gib: float | None = None) -> memory.Measurement:
    sampler = memory.Sampler(interval=1.0)  # never started: its peaks are set by hand
    sampler.cluster.pss = (policy_gib + 2.0) * memory.GIB
    sampler.groups["policy (DeepSpeed)"] = memory.Peaks(pss=policy_gib * memory.GIB)
    if reference_gib is not None:
        sampler.groups["reference"] = memory.Peaks(pss=reference_gib * memory.GIB)
    metrics = [
        {"step": i, "time/step": s, "time/train_actor": s / 2, "sync/mb": 10.0, "reward/mean": 0.1 * i}
        for i, s in enumerate(step_s)
    ]
    return memory.Measurement(sampler, seconds=100.0, load_before=0.0, metrics=metrics)


def test_summarize_skips_the_first_step_and_reads_the_peaks():
    result = lora.summarize("full", fake_measurement(4.0, [100.0, 10.0, 20.0]))
    assert result.values["time/step (s)"] == pytest.approx(15.0)  # the warm-up step's 100 s is left out
    assert result.values["time/train_actor (s)"] == pytest.approx(7.5)
    assert result.values["peak PSS, policy (GiB)"] == pytest.approx(4.0)
    assert result.values["peak PSS, whole cluster (GiB)"] == pytest.approx(6.0)
    assert result.values["peak PSS, reference (GiB)"] is None
    assert result.values["time/rollout (s)"] is None  # not logged
    assert result.values["reward/mean, last step"] == pytest.approx(0.2)


def test_table_gives_ratios_to_the_first_arm_and_drops_empty_rows():
    results = [
        lora.summarize("ref_auto", fake_measurement(4.0, [50.0, 10.0, 10.0])),
        lora.summarize("ref_on", fake_measurement(4.0, [50.0, 12.0, 12.0], reference_gib=1.0)),
    ]
    lines = lora.table(results)
    assert lines[0] == "| figure | ref_auto | ref_on |"
    assert "| time/step (s) | 10.00 | 12.00 (1.20x) |" in lines
    assert "| peak PSS, reference (GiB) | - | 1.00 |" not in lines  # no ratio to a missing figure
    assert "| peak PSS, reference (GiB) | - | 1.00 (-) |" in lines
    assert not any(line.startswith("| time/rollout") for line in lines)  # no arm has it
    assert lora.headline(results) == "ref_on_over_ref_auto_step: 1.200"


def test_arms_must_be_known_and_steps_at_least_two():
    args, rest = lora.parse_args(["--arms", "ref_auto,ref_on", "--rollout.batch_size", "4"])
    assert args.arms == ["ref_auto", "ref_on"] and rest == ["--rollout.batch_size", "4"]
    with pytest.raises(SystemExit):
        lora.parse_args(["--arms", "full,nope"])
    with pytest.raises(SystemExit):
        lora.parse_args(["--steps", "1"])
