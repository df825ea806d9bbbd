"""Checkpoints and resume, done for real.

- A whole job (`python pipelines/<kl_cov|clip_cov>.py`, its own local Ray, every actor) is SIGKILLed as a process
  group in the middle of step 3, after its step-2 checkpoint and after step 2 was logged, then run again with
  `--train.resume true`. The resumed run starts at the checkpoint's step, so step 2 is really done twice, and its
  steps repeat, number for number and sample for sample, those of an uninterrupted run with the same seed (for
  Clip-Cov that includes its random choice of tokens); the first steps of the killed run match the uninterrupted
  run too (determinism of two synchronous runs). A planted half-written `.tmp-step4` folder is not picked.
- A resume with another seed is refused before any actor starts, and so is a fresh run in a folder that holds
  checkpoints (it would save between them, and a later resume could continue the earlier run).
- A policy group restored from a DeepSpeed checkpoint has the saved weights, optimizer moments, learning-rate
  schedule and RNG state: its next step is bit-identical to the step the saving group took.
- Both runs use a cosine learning-rate schedule with warmup, so the logged `train/lr` of a resumed run must repeat
  the uninterrupted run's, which follows the schedule's formula.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"
# synchronous (staleness 0) so the runs are deterministic; no reference model, to start faster
FLAGS = [
    "--preset", "smoke", "--train.num_steps", "4", "--train.save_every", "2", "--async.max_staleness", "0",
    "--reward.verifier", VERIFIER, "--ref.enabled", "false",
    # a tiny random model's covariances are far below Clip-Cov's bounds of 1 and 5: widen them so it selects
    "--loss.clip_cov.lb=-100", "--loss.clip_cov.ub=100",
    # the entropy controller, with a band above any entropy a 384-token vocabulary allows (ln 384 = 5.95 nats): its
    # scale rises every step, so a resume that lost its state would train and log differently from the checkpoint on
    "--entropy.target", "20,30", "--entropy.knob", "ratio",
    # a learning rate that changes at every optimizer step: a resume that restarted the schedule, or lost its place
    # in it, would log another train/lr and train differently from the checkpoint on
    "--actor.lr_scheduler", "cosine", "--actor.lr_warmup_steps", "3",
]  # fmt: skip


def scheduled_lr(k: int, warmup: int = 3, total: int = 8) -> float:
    """The smoke preset's lr 1e-4 at optimizer step k: warmup k / 3, then a cosine to 0 at the run's 4 steps x 2
    mini-batches = 8 optimizer steps."""
    return 1e-4 * (k / warmup if k < warmup else (1 + math.cos(math.pi * (k - warmup) / (total - warmup))) / 2)


# each RL step logs the rate of its last optimizer step: 1, 3, 5, 7
WANT_LR = [scheduled_lr(k) for k in (1, 3, 5, 7)]
RUN_TIMEOUT_S = 900
# numbers that depend on the machine's speed, not on what was computed
TIMING = ("time/", "throughput/", "reward/seconds_per_sample")


def start_job(out: Path, ray_tmp: Path, *extra: str, pipeline: str = "kl_cov") -> subprocess.Popen:
    """The pipeline as a user runs it, in its own session (process group) with its own local Ray under ray_tmp."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ID")}
    env["RAY_TMPDIR"] = str(ray_tmp)  # this run's Ray files, so its leftovers can be found and ended
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, f"pipelines/{pipeline}.py", *FLAGS, "--train.output_dir", str(out), *extra],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def job_log(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")


def leftover_pids(pgid: int, ray_tmp: Path) -> list[int]:
    """Processes of the job still alive: in its process group, or carrying its RAY_TMPDIR (Ray's daemons and
    workers inherit the driver's environment, whatever process group they run in)."""
    found = {int(p) for p in subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()}
    tag = f"RAY_TMPDIR={ray_tmp}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if tag in (proc / "environ").read_bytes().split(b"\0"):
                    found.add(int(proc.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return sorted(found - {os.getpid()})


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the job's whole process group at once, as a lost node or an OOM kill of the session would."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def wait_gone(proc: subprocess.Popen, ray_tmp: Path, timeout_s: float = 60.0) -> list[int]:
    """Ray's daemons and workers outside the process group notice their driver's death and exit; return any that
    are still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (pids := leftover_pids(proc.pid, ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids


def end_job(proc: subprocess.Popen, ray_tmp: Path) -> None:
    """Kill the job, then anything of it still alive (so a failing test leaves nothing behind)."""
    kill_job(proc)
    for _ in range(40):
        pids = leftover_pids(proc.pid, ray_tmp)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def run_to_end(out: Path, ray_tmp: Path, *extra: str, pipeline: str = "kl_cov") -> str:
    proc = start_job(out, ray_tmp, *extra, pipeline=pipeline)
    try:
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, job_log(out)[-4000:]
    finally:
        end_job(proc, ray_tmp)
    return job_log(out)


def logged(out: Path) -> dict[int, dict]:
    """step -> the metrics the runs in the output folder logged (its metrics.jsonl, whose rows of a step a resume
    redoes are the resumed run's)."""
    steps = {}
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        steps[row["step"]] = {k: v for k, v in row.items() if not k.startswith(TIMING)}
    return steps


def sample_tables(out: Path) -> dict[int, list]:
    """step -> the rows of the sample table W&B saved for it (prompt, response, label, reward, version)."""
    tables = {}
    for path in (out / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"):
        step = int(path.name.split("_")[1])
        tables[step] = json.loads(path.read_text())["data"]
    return tables


@pytest.fixture
def ray_tmp():
    # short: Ray's socket paths must stay under the 107-byte limit
    path = Path(tempfile.mkdtemp(prefix="eor_rs_", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(2400)  # three and a half pipeline runs
@pytest.mark.parametrize("pipeline", ["kl_cov", "clip_cov"])
def test_killed_job_resumes_from_its_last_checkpoint_and_repeats_an_uninterrupted_run(tmp_path, ray_tmp, pipeline):
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"

    # 1. the run as it should go: 4 steps, checkpoints at steps 2 and 4
    run_to_end(reference, ray_tmp, pipeline=pipeline)
    want = logged(reference)
    assert sorted(want) == [0, 1, 2, 3]
    if pipeline == "clip_cov":
        assert all(want[s]["loss/clip_cov_frac"] > 0 for s in (2, 3))  # its random choice acts in the redone steps
    # the controller pushes toward more entropy at every step: its error is positive and its scale grows
    scales = [want[s]["entropy_ctl/scale"] for s in range(4)]
    assert all(want[s]["entropy_ctl/error"] > 0 for s in range(4))
    assert 1 < scales[0] < scales[1] < scales[2] < scales[3], scales
    # below the band the entropy bonus is raised too (from 0: step 0 trains without it), and the resumed steps below
    # must repeat it: the bonus comes back from the checkpoint with the scale
    assert all(want[s]["entropy_ctl/bonus"] > 0 for s in range(4))
    assert want[0]["loss/entropy_bonus"] == 0 and all(want[s]["loss/entropy_bonus"] > 0 for s in (1, 2, 3))
    # and it reaches the actor: the selected share grows with the scaled ratio (step 0 trains at scale 1)
    frac = f"loss/{pipeline}_frac"
    assert want[3][frac] > 2 * want[0][frac], (want[0][frac], want[3][frac])
    # the learning rate follows its schedule; a resume that restarted it would log steps 0 and 1's rates at steps 2
    # and 3, and with 3 warmup steps neither matches (with 2, step 2's would, by chance)
    assert [want[s]["train/lr"] for s in range(4)] == pytest.approx(WANT_LR, rel=1e-9)
    assert all(abs(a - b) > 1e-6 for a, b in zip(WANT_LR[2:], WANT_LR[:2]))

    # 2. the same run, killed (every process of it, at once) in step 3: after the step-2 checkpoint and after step 2
    # was logged, so the resumed run redoes work that was already logged
    proc = start_job(killed, ray_tmp, pipeline=pipeline)
    marker = killed / "checkpoints" / "step2" / "trainer_state.json"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (marker.exists() and 2 in logged(killed)):
            assert proc.poll() is None, f"the run ended before step 2 was logged:\n{job_log(killed)[-4000:]}"
            assert time.monotonic() < deadline, "step 2 was not logged in time"
            time.sleep(0.2)
        kill_job(proc)
        survivors = wait_gone(proc, ray_tmp)
    finally:
        end_job(proc, ray_tmp)
    assert proc.returncode == -signal.SIGKILL
    assert survivors == []  # nothing of the killed job (driver, Ray, actors) lived on
    before_kill = logged(killed)
    assert set(before_kill) == {0, 1, 2}  # killed in step 3, never to step 4's checkpoint
    assert not (killed / "checkpoints" / "step4").exists()

    # determinism: the same seed gave the same rollouts and the same losses
    for step in (0, 1, 2):
        assert before_kill[step] == want[step], step
    assert sample_tables(killed)[0] == sample_tables(reference)[0]

    # a save cut short leaves a temporary folder; plant one that claims a later step: it must not be picked
    half = killed / "checkpoints" / ".tmp-step4"
    shutil.copytree(killed / "checkpoints" / "step2", half)
    (half / "trainer_state.json").write_text(json.dumps({"step": 4, "stream_epoch": 0, "stream_offset": 16}))
    shutil.rmtree(half / "deepspeed")

    # a resume that could not continue the run (another seed) is refused before any actor starts
    proc = start_job(killed, ray_tmp, "--train.resume", "true", "--train.seed", "7", pipeline=pipeline)
    try:
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 2
    finally:
        end_job(proc, ray_tmp)
    log = job_log(killed)
    assert "was written with --train.seed 42, this run has 7" in log, log[-3000:]
    assert log.count("actors started") == 1  # the killed run's only

    # 3. resume: it continues at the checkpoint's step, with the checkpoint's weights, optimizer, data position and
    # RNG, so its steps repeat the uninterrupted run's exactly, the logged step 2 included
    log = run_to_end(killed, ray_tmp, "--train.resume", "true", pipeline=pipeline)
    assert f"resumed from {killed / 'checkpoints' / 'step2'} at step 2" in log
    rows = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    replaced = [json.loads(x) for x in (killed / "metrics.replaced.jsonl").read_text().splitlines()]
    # first trained step = the checkpoint's; only the steps since it are redone: the killed run's row of step 2 was
    # moved aside for the resumed run's, its rows of steps 0 and 1 kept
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and [r["step"] for r in replaced] == [2]
    redone = {r["step"]: r for r in rows}
    assert {k: v for k, v in redone[2].items() if not k.startswith(TIMING)} == before_kill[2]
    after = logged(killed)
    # the schedule came back with the checkpoint: the resumed steps run at the uninterrupted run's rates
    assert [after[s]["train/lr"] for s in (2, 3)] == [want[s]["train/lr"] for s in (2, 3)]
    for step in (2, 3):
        assert after[step] == want[step], step
    tables, want_tables = sample_tables(killed), sample_tables(reference)
    assert tables[2] == want_tables[2] and tables[3] == want_tables[3]
    assert (killed / "checkpoints" / "step4" / "trainer_state.json").exists()
    assert json.loads((killed / "checkpoints" / "step4" / "trainer_state.json").read_text())["step"] == 4
    assert (killed / "final" / "config.json").exists()

    if pipeline == "kl_cov":
        # 4. a fresh run (no --train.resume) in the same folder is refused before any actor starts: it would save
        # between the old checkpoints (rotation keeping the newest of both runs), and a resume could continue either
        old_state = (killed / "checkpoints" / "step4" / "trainer_state.json").stat().st_mtime_ns
        proc = start_job(killed, ray_tmp, "--train.num_steps", "2", pipeline=pipeline)
        try:
            assert proc.wait(timeout=RUN_TIMEOUT_S) == 2
        finally:
            end_job(proc, ray_tmp)
        log = job_log(killed)
        refusal = "holds checkpoints of an earlier run (newest: step4): --train.resume true continues it"
        assert refusal in log, log[-3000:]
        assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step2", "step4"]  # untouched
        assert (killed / "checkpoints" / "step4" / "trainer_state.json").stat().st_mtime_ns == old_state


def test_policy_checkpoint_restores_weights_optimizer_and_rng(ray_cluster, tiny_model, tmp_path):
    import ray

    from entropy_openrlhf.actors.policy import PolicyGroup
    from entropy_openrlhf.config import from_args
    from tests.integration.test_policy import fixed_batch

    # a schedule whose rate changes at every optimizer step: the restored step must run at the saved step's rate
    flags = ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3",
             "--actor.lr_scheduler", "cosine", "--actor.lr_warmup_steps", "1"]  # fmt: skip
    cfg = from_args(flags, {"loss.type": "ppo"})
    group = PolicyGroup(cfg, tiny_model)
    actor = group.actors[0]
    ckpt = str(tmp_path / "deepspeed")

    def rng() -> torch.Tensor:
        return ray.get(actor.__ray_call__.remote(lambda self: torch.get_rng_state()))

    def same(a: dict, b: dict) -> bool:
        return all(torch.equal(a[k], b[k]) for k in a)

    try:
        group.train_step(fixed_batch(seed=0), 0)  # Adam has moments now
        group.call_all("save_checkpoint", ckpt, "state")
        saved_weights, saved_rng = group.call_all("export_weights")[0], rng()
        group.train_step(fixed_batch(seed=1), 1)
        want = group.call_all("export_weights")[0]
        ray.get(actor.__ray_call__.remote(lambda self: torch.rand(1000)))  # dropout would have drawn meanwhile
        assert not torch.equal(rng(), saved_rng)

        # control: the weights alone, with the optimizer as it is now, give another step
        def load_weights_only(self) -> None:
            self.engine.load_checkpoint(ckpt, "state", load_optimizer_states=False)

        ray.get(actor.__ray_call__.remote(load_weights_only))
        group.train_step(fixed_batch(seed=1), 1)
        assert not same(group.call_all("export_weights")[0], want)

        group.call_all("load_checkpoint", ckpt, "state")
        assert same(group.call_all("export_weights")[0], saved_weights)
        assert torch.equal(rng(), saved_rng)
        group.train_step(fixed_batch(seed=1), 1)
        assert same(group.call_all("export_weights")[0], want)  # bit for bit: the optimizer state came back

        with pytest.raises(Exception, match="no DeepSpeed checkpoint 'state' in"):
            group.call_all("load_checkpoint", str(tmp_path / "nothing"), "state")
    finally:
        group.shutdown()
