"""scripts/gpu_preflight.sh --cpu: the GPU preflight's CPU twin, the same script and report on a tiny model with two
ZeRO-3 ranks and the collective sync over gloo, so the script a GPU user runs first is known to work."""

import re
import subprocess
from pathlib import Path

import pytest

from entropy_openrlhf.pipeline.gpu_preflight import CHECKS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
# the digit-share verifier gives a tiny random model rewards that differ within groups, so the steps train
VERIFIER = str(ROOT / "tests" / "integration" / "verifiers.py") + ":digit_share"


@pytest.mark.timeout(1500)  # two pipeline runs under the subprocess's own 1200 s limit
def test_cpu_twin_passes_every_check(tmp_path):
    out = tmp_path / "preflight"
    proc = subprocess.run(
        ["bash", "scripts/gpu_preflight.sh", "--cpu", "--output-dir", str(out), "--reward.verifier", VERIFIER],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    report = {m.group(2).strip(): m.group(1) for m in re.finditer(r"^(PASS|FAIL)  (.{12})  ", proc.stdout, re.M)}
    assert report == dict.fromkeys(CHECKS, "PASS"), proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0
    assert "gloo, 2 ranks (expected gloo)" in proc.stdout
    assert "a stale engine would go unseen" not in proc.stdout  # one step moves log-probs past the bound
    assert (out / "run1.log").is_file() and (out / "run2.log").is_file()
