"""`ray job submit` of pipelines/kl_cov.py, as a user does it, against a plain Ray head on 127.0.0.1 that has Ray's
laptop default of 2 logical CPUs and none of the project's CPU settings in its environment; and of the OpenRLHF
route's stand-in for train_ppo_ray on the same head (one head for the module)."""

import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
DASH, GCS = "8275", "6395"
EXCLUDES = [".venv*", "outputs", "wandb", ".git"]
# what tests/conftest.py and the Makefile export for in-process runs; a user's shell has none of it
PROJECT_ENV = (
    "MASTER_ADDR", "DS_ACCELERATOR", "WANDB_MODE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_OMP_THREADS_BIND", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "WANDB_API_KEY",
)  # fmt: skip


def hold_default_agent_port() -> socket.socket | None:
    """Listen on the dashboard agent's default port, as another Ray on the machine would; None if one already does."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 52365))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head started by scripts/ray_head.sh (`ray start --head --num-cpus 2` on loopback), stopped by its id.
    Its HOME (so its jobs' drivers' too) is a temp folder: a job that leaves --train.output_dir out writes under
    ~/entropy-openrlhf/outputs/run, which must not be the real home."""
    tmp = tempfile.mkdtemp(prefix="eor_e2e_", dir="/tmp")
    held = hold_default_agent_port()  # the head must not depend on that port being free
    env = {k: v for k, v in os.environ.items() if k not in PROJECT_ENV}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"
    env["HOME"] = str(tmp_path_factory.mktemp("head_home"))
    # DeepSpeed's CPU ops, built once, stay where `make test` keeps them (not rebuilt under the temp home)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    subprocess.run(["bash", "scripts/ray_head.sh", "start", tmp, DASH, GCS], cwd=ROOT, check=True, env=env)
    try:
        yield env
        # after the jobs, with their workers about: the head runs with authentication off, so none of its
        # processes may listen beyond loopback (the script checks this at start too, before any worker exists)
        check = subprocess.run(
            ["bash", "scripts/ray_head.sh", "check", tmp], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
        seen = re.search(r"(\d+) processes, (\d+) listening TCP sockets, all on loopback", check.stdout)
        assert seen and int(seen[1]) >= 3 and int(seen[2]) >= 3, check.stdout  # GCS, raylet, dashboard at least
    finally:
        subprocess.run(["bash", "scripts/ray_head.sh", "stop", tmp], cwd=ROOT, env=env)
        if held:
            held.close()
    assert subprocess.run(["pgrep", "-f", tmp], capture_output=True).returncode == 1  # nothing of it left


def submit(env: dict, runtime_env: dict, args: list[str], timeout: float, pipeline: str = "kl_cov") -> tuple[int, str]:
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/ray"), "job", "submit", "--address", f"http://127.0.0.1:{DASH}", "--working-dir", ".",
         "--runtime-env-json", json.dumps(runtime_env), "--", "python", f"pipelines/{pipeline}.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(1200)  # above the submit's own 900 s, so that limit is the one that reports a slow job
def test_smoke_job_on_a_two_cpu_head_with_the_wandb_key_in_the_runtime_env(head):
    """A submission with no --train.output_dir: the run resolves it to ~/entropy-openrlhf/outputs/run on the driver's
    node (outside Ray's copy of the working dir, which Ray deletes with the job), says so at start, and its final
    model and W&B run land there."""
    # The W&B key as docs/guides/cluster.md shows it: in the job's runtime env (a fake key, offline, nothing leaves).
    runtime_env = {"env_vars": {"WANDB_API_KEY": "0" * 40, "WANDB_MODE": "offline"}, "excludes": EXCLUDES}
    out_dir = Path(head["HOME"]) / "entropy-openrlhf" / "outputs" / "run"
    code, log = submit(head, runtime_env, ["--preset", "smoke"], timeout=900)
    assert code == 0, log[-4000:]
    assert re.search(r"Job '\S+' succeeded", log), log[-4000:]
    assert f"[entropy-openrlhf] output folder: {out_dir}\n" in log, log[-4000:]
    assert "scaled to fit" in log  # the run reserves 2.75 logical CPUs; the head has 2
    assert "first step mean reward" in log
    final = out_dir / "final"
    assert (final / "config.json").exists() and (final / "tokenizer_config.json").exists()
    runs = list((out_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all("entropy/token_mean" in m for m in metrics)
    assert list(runs[0].glob("run-*.wandb")), "W&B wrote no run file"  # the offline run W&B itself would sync


@pytest.mark.timeout(1200)
def test_a_lora_job_syncs_only_the_adapter_and_saves_it_beside_the_merged_model(head, tmp_path):
    """`pipelines/dppo.py --actor.lora_rank` through `ray job submit` on the built-in task (docs/guides/lora.md):
    the adapter sync, the reference as the base, the final folder merged with the adapter beside it. DPPO with the
    entropy-based advantage (docs/algorithms/losses.md), so that objective and the option run as a job too."""
    out_dir = tmp_path / "run"
    args = ["--preset", "smoke", "--train.output_dir", str(out_dir), "--actor.lora_rank", "8", "--ref.enabled", "true",
            "--algo.entropy_adv_alpha", "0.4"]  # fmt: skip
    code, log = submit(head, {"excludes": EXCLUDES}, args, timeout=900, pipeline="dppo")
    assert code == 0, log[-4000:]
    assert "weight sync: adapter only" in log, log[-4000:]
    final = out_dir / "final"
    assert (final / "config.json").exists() and (final / "adapter" / "adapter_config.json").exists()
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(0 < m["sync/mb"] < 1 for m in metrics)  # a rank-8 adapter of the tiny model: well under a MiB
    assert metrics[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the base
    assert all("loss/dppo_masked_frac" in m and "loss/entropy_adv_shift" in m for m in metrics)


@pytest.mark.timeout(1200)
def test_the_openrlhf_route_s_setup_hook_under_ray_job_submit(head):
    """The OpenRLHF route (tests/integration/test_openrlhf_route.py, its stand-in for train_ppo_ray) as a job on this
    head: the job's runtime env (working_dir) and the one our hook adds to OpenRLHF's ray.init are merged by Ray, and
    the objective is installed in OpenRLHF's policy actor while a plain task of the job stays light."""
    from tests.integration.test_openrlhf_route import OBJECTIVE_FLAGS, check_probes, run_child

    submit = [str(ROOT / ".venv/bin/ray"), "job", "submit", "--address", f"http://127.0.0.1:{DASH}",
              "--working-dir", ".", "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--",
              "python", "-m", "tests.integration.test_openrlhf_route", "route", *OBJECTIVE_FLAGS,
              "--timeout", "600"]  # fmt: skip
    check_probes(run_child(submit, timeout=900, env=head), ranks=1)


def test_a_run_that_needs_missing_gpus_fails_in_one_line(head, tmp_path):
    # A placement wait longer than the submit's own limit: a job that got past the fit check to wait for its GPUs
    # would be cut by the submit's timeout (and fail this test) rather than fail in the expected line.
    args = ["--preset", "smoke", "--train.output_dir", str(tmp_path / "run"),
            "--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "1", "--ref.enabled", "true",
            "--ray.placement_timeout_s", "3600"]  # fmt: skip
    code, log = submit(head, {"excludes": EXCLUDES}, args, timeout=300)
    assert code != 0 and re.search(r"Job '\S+' failed", log), log[-4000:]
    errors = {line for line in log.splitlines() if line.startswith("error: ")}  # Ray repeats the job's last lines
    # the reference (on: by default only a KL term starts it) follows the policy onto a GPU (--ref.num_gpus -1,
    # auto): three GPUs in all
    assert errors == {
        "error: the run does not fit the Ray cluster: needs 3 GPUs, the cluster has 0 free: rollout 1 "
        "(--rollout.num_engines x --rollout.num_gpus_per_engine), policy 1 (--actor.num_workers x "
        "--actor.num_gpus_per_worker), reference 1 (--ref.num_workers x --ref.num_gpus)"
    }, log[-3000:]


def ray_job(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / ".venv/bin/ray"), "job", *args, "--address", f"http://127.0.0.1:{DASH}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_sigterm_from_ray_job_stop_shuts_the_job_down_and_says_how_to_resume(head, tmp_path):
    # `ray job stop` sends SIGTERM and SIGKILLs RAY_JOB_STOP_WAIT_TIME_S later: 3 s by default, 30 here, as
    # docs/guides/reliability.md tells users to set it (in the job's runtime env, which Ray's job supervisor runs in)
    runtime_env = {"env_vars": {"WANDB_MODE": "offline", "RAY_JOB_STOP_WAIT_TIME_S": "30"}, "excludes": EXCLUDES}
    out_dir = tmp_path / "run"
    job_id = f"eor-sigterm-{os.getpid()}"
    submitted = subprocess.run(
        [str(ROOT / ".venv/bin/ray"), "job", "submit", "--no-wait", "--submission-id", job_id,
         "--address", f"http://127.0.0.1:{DASH}", "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env),
         "--", "python", "pipelines/sapo.py", "--preset", "smoke", "--train.output_dir", str(out_dir),
         "--train.num_steps", "50", "--train.save_every", "1", "--rollout.mode", "partial"],  # far more steps than
        # it gets to run; SAPO's pipeline and partial rollouts as a job
        cwd=ROOT, env=head, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    try:
        deadline = next_status = time.monotonic()
        deadline += 600
        while not list((out_dir / "checkpoints").glob("step*/trainer_state.json")):
            if time.monotonic() > next_status:  # the CLI takes seconds: asked now and then, the folder polled often
                status = ray_job(head, "status", job_id).stdout
                assert "RUNNING" in status or "PENDING" in status, status + ray_job(head, "logs", job_id).stdout[-4000:]
                next_status = time.monotonic() + 10
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.2)
        t0 = time.monotonic()
        stopped = ray_job(head, "stop", job_id)  # waits until the job has ended
        seconds = time.monotonic() - t0
    finally:
        ray_job(head, "stop", job_id)  # a no-op once it has ended
    log = ray_job(head, "logs", job_id).stdout
    print(f"`ray job stop` returned after {seconds:.1f} s")
    assert stopped.returncode == 0 and "was stopped" in ray_job(head, "status", job_id).stdout, stopped.stdout
    lines = log.splitlines()
    stop_line = next((line for line in lines if "stopped by SIGTERM during step" in line), None)
    print(stop_line)
    # printed after the shut-down, so the clean stop ended before the supervisor's SIGKILL
    assert stop_line is not None, log[-4000:]
    assert re.search(r"newest complete checkpoint: \S+/checkpoints/step\d+ ", stop_line), stop_line
    command = lines[lines.index(stop_line) + 1].strip()
    assert command.startswith("ray job submit <your options> -- python pipelines/sapo.py --preset smoke")
    assert command.endswith("--train.save_every 1 --rollout.mode partial --train.resume true"), command
    assert all(p.name.startswith("step") for p in (out_dir / "checkpoints").iterdir())  # no .tmp-step<N>
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all("loss/sapo_gate_mean" in m for m in metrics)  # SAPO trained the steps it ran
