"""scripts/gpu_preflight.sh --cpu: the GPU preflight's CPU twin, the same script and report on a tiny model with two
ZeRO-3 ranks and the collective sync over gloo, so the script a GPU user runs first is known to work. It runs as a
new user would run it, with no flag beyond the output folder: the twin's own reward must make the steps train."""

import re
import subprocess
from pathlib import Path

import pytest

from entropy_openrlhf.pipeline.gpu_preflight import CHECKS, checkpoint_gaps

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(1500)  # two pipeline runs under the subprocess's own 1200 s limit
def test_cpu_twin_passes_every_check(tmp_path):
    out = tmp_path / "preflight"
    proc = subprocess.run(
        ["bash", "scripts/gpu_preflight.sh", "--cpu", "--output-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    verdicts = {m.group(2): m.group(1) for m in re.finditer(r"^(\w+) +(.{12})  ", proc.stdout, re.M)}
    assert {k.strip(): v for k, v in verdicts.items()} == dict.fromkeys(CHECKS, "PASS"), (
        proc.stdout + proc.stderr[-3000:]
    )
    assert proc.returncode == 0
    assert "gloo, 2 ranks (expected gloo)" in proc.stdout
    # the update is real: a gradient in both steps, and one step moves log-probs past the sync bound, so both the
    # train-step and the weight-sync lines could have failed
    norms = re.search(r"grad norms ([\d.e+-]+), ([\d.e+-]+)", proc.stdout)
    assert norms and all(float(g) > 0 for g in norms.groups()), proc.stdout
    assert "a stale engine would go unseen" not in proc.stdout
    assert not checkpoint_gaps(out / "checkpoints" / "step2")
    assert (out / "run1.log").is_file() and (out / "run2.log").is_file()
