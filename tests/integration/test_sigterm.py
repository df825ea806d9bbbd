"""SIGTERM to the driver of a local run, done for real: what `ray job stop`, SLURM and Kubernetes send before their
SIGKILL (docs/guides/reliability.md).

The smoke run is stopped while it saves its step-2 checkpoint (the moment `.tmp-step2` appears), the worst moment
for its checkpoints. The driver must end within STOP_BOUND_S with exit code 143, shut every actor and Ray process it
started down, leave no `.tmp-step<N>` folder and only complete checkpoints, and print the command that resumes;
that command, run as printed, continues from the newest checkpoint to the end.

The run streams partial rollouts one version ahead (`--rollout.mode partial --async.max_staleness 1`, over the
object-store sync), so the
checkpoint holds prompts drawn and not yet trained (`open_prompts`), which the resumed run rolls out again first
(the bookkeeping, prompt by prompt: tests/unit/test_stream_resume.py). A batch-mode run's resume is
tests/integration/test_resume.py's.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from entropy_openrlhf.pipeline.checkpoints import latest_checkpoint
from tests.integration.test_resume import ROOT, end_job, job_log, logged, start_job, wait_gone

pytestmark = pytest.mark.integration

# Kubernetes' default grace period before its SIGKILL (SLURM's KillWait is 30 s too); measured: about 10 s
STOP_BOUND_S = 30.0
RUN_TIMEOUT_S = 900


@pytest.fixture
def ray_tmp():
    # short: Ray's socket paths must stay under the 107-byte limit
    path = Path(tempfile.mkdtemp(prefix="eor_st_", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(1500)  # a run stopped in its second step, then the resumed run
def test_sigterm_mid_save_stops_cleanly_and_prints_the_command_that_resumes(tmp_path, ray_tmp):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    # over the object-store sync: the partial-rollout tests of tests/integration/test_streaming_pipeline.py run the
    # collective and the adapter syncs
    streaming = ("--rollout.mode", "partial", "--async.max_staleness", "1", "--sync.method", "object_store")
    proc = start_job(out, ray_tmp, "--train.num_steps", "3", "--train.save_every", "1", *streaming)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # polled often: the tiny model's save lasts a second or two, and the signal should land inside it
        while not ((checkpoints / ".tmp-step2").exists() or (checkpoints / "step2").exists()):
            assert proc.poll() is None, f"the run ended before its step-2 save:\n{job_log(out)[-4000:]}"
            assert time.monotonic() < deadline, "no step-2 save within the run's time limit"
            time.sleep(0.02)
        mid_save = not (checkpoints / "step2").exists()
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the driver only, as Kubernetes signals a container's first process
        code = proc.wait(timeout=120)
        seconds = time.monotonic() - t0
        left = wait_gone(proc, ray_tmp, timeout_s=30)
    finally:
        end_job(proc, ray_tmp)
    log = job_log(out)
    where = "inside" if mid_save else "after"
    print(f"stopped {where} the step-2 save; the driver ended {seconds:.1f} s after SIGTERM")

    assert code == 143, log[-4000:]  # Ray's own handler (sys.exit(15)) would give 15, with no message
    assert seconds < STOP_BOUND_S, log[-4000:]
    assert left == [], f"processes of the run alive after it ended: {left}"
    assert [p.name for p in checkpoints.iterdir() if not p.name.startswith("step")] == []  # no .tmp-/.del-/.old-
    newest = latest_checkpoint(checkpoints)
    assert newest is not None and newest.name in ("step1", "step2"), sorted(p.name for p in checkpoints.iterdir())
    for part in ("trainer_state.json", "deepspeed/state", "hf/config.json"):
        assert (newest / part).exists(), part
    # one version ahead, the next step's groups were drawn while the saved step trained
    open_prompts = json.loads((newest / "trainer_state.json").read_text())["open_prompts"]
    assert open_prompts and len({tuple(p) for p in open_prompts}) == len(open_prompts), open_prompts
    lines = log.splitlines()
    stop_line = next((line for line in lines if "stopped by SIGTERM during step" in line), None)
    assert stop_line is not None, log[-4000:]
    assert f"newest complete checkpoint: {newest}" in stop_line, stop_line
    command = shlex.split(lines[lines.index(stop_line) + 1].strip())
    assert command[:2] == ["python", "pipelines/kl_cov.py"] and command[-2:] == ["--train.resume", "true"], command

    # the printed command, as a user pastes it (the same interpreter for `python`), continues from `newest`
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ID")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    resumed = subprocess.run(
        [sys.executable, *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    steps_done = int(newest.name.removeprefix("step"))
    assert f"resumed from {newest} at step {steps_done}" in resumed.stdout
    assert f"{len(open_prompts)} prompts in flight or buffered at the save are rolled out again" in resumed.stdout
    assert set(logged(out)) == {0, 1, 2}  # steps 0-1 logged before the stop, the rest by the resumed run
    assert latest_checkpoint(checkpoints) == checkpoints / "step3"
