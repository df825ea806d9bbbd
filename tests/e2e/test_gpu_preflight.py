"""scripts/gpu_preflight.sh --cpu: the GPU preflight's CPU twin, the same script and report on a tiny model with two
ZeRO-3 ranks and the collective sync over gloo, so the script a GPU user runs first is known to work. It runs as a
new user would run it, from a shell without our exports and with no flag beyond the output folder: the twin's own
reward must make the steps train.

Its two runs of `python pipelines/kl_cov.py` are local runs started the way a user starts one, so they must not listen
beyond loopback (their Ray runs with authentication off, docs/guides/cpu.md): the listening sockets of every process
the script started are polled from the outside while it runs (tests/e2e/test_loopback.py's Watcher)."""

import re
from pathlib import Path

import pytest

from entropy_openrlhf.pipeline.gpu_preflight import CHECKS, checkpoint_gaps
from tests.e2e.test_loopback import assert_listened_on_loopback_only, run_watched

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(1500)  # two pipeline runs under the subprocess's own 1200 s limit
def test_cpu_twin_passes_every_check_and_listens_on_loopback_only(tmp_path):
    out = tmp_path / "preflight"
    proc, watcher = run_watched(
        ["bash", "scripts/gpu_preflight.sh", "--cpu", "--output-dir", str(out)], timeout=1200, separate_stderr=True
    )
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
    assert_listened_on_loopback_only(watcher)
