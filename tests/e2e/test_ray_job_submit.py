"""`ray job submit` of pipelines/kl_cov.py, as a user does it, against a plain Ray head on 127.0.0.1 that has Ray's
laptop default of 2 logical CPUs and none of the project's CPU settings in its environment."""

import json
import os
import re
import socket
import subprocess
import tempfile
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
def head():
    """A Ray head started by scripts/ray_head.sh (`ray start --head --num-cpus 2` on loopback), stopped by its id."""
    tmp = tempfile.mkdtemp(prefix="eor_e2e_", dir="/tmp")
    held = hold_default_agent_port()  # the head must not depend on that port being free
    env = {k: v for k, v in os.environ.items() if k not in PROJECT_ENV}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"
    subprocess.run(["bash", "scripts/ray_head.sh", "start", tmp, DASH, GCS], cwd=ROOT, check=True, env=env)
    try:
        yield env
    finally:
        subprocess.run(["bash", "scripts/ray_head.sh", "stop", tmp], cwd=ROOT, env=env)
        if held:
            held.close()
    assert subprocess.run(["pgrep", "-f", tmp], capture_output=True).returncode == 1  # nothing of it left


def submit(env: dict, runtime_env: dict, args: list[str], timeout: float) -> tuple[int, str]:
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/ray"), "job", "submit", "--address", f"http://127.0.0.1:{DASH}", "--working-dir", ".",
         "--runtime-env-json", json.dumps(runtime_env), "--", "python", "pipelines/kl_cov.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(1200)  # above the submit's own 900 s, so that limit is the one that reports a slow job
def test_smoke_job_on_a_two_cpu_head_with_the_wandb_key_in_the_runtime_env(head, tmp_path):
    # The W&B key as docs/cluster.md shows it: in the job's runtime env (a fake key, offline, nothing leaves).
    runtime_env = {"env_vars": {"WANDB_API_KEY": "0" * 40, "WANDB_MODE": "offline"}, "excludes": EXCLUDES}
    out_dir = tmp_path / "run"
    code, log = submit(head, runtime_env, ["--preset", "smoke", "--train.output_dir", str(out_dir)], timeout=900)
    assert code == 0, log[-4000:]
    assert re.search(r"Job '\S+' succeeded", log), log[-4000:]
    assert "scaled to fit" in log  # the run reserves 2.75 logical CPUs; the head has 2
    assert "first step mean reward" in log
    final = out_dir / "final"
    assert (final / "config.json").exists() and (final / "tokenizer_config.json").exists()
    runs = list((out_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    metrics = [json.loads(line) for line in (runs[0] / "files" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all("entropy/token_mean" in m for m in metrics)
    assert list(runs[0].glob("run-*.wandb")), "W&B wrote no run file"  # the offline run W&B itself would sync


def test_a_run_that_needs_missing_gpus_fails_in_one_line(head, tmp_path):
    # A placement wait longer than the submit's own limit: a job that got past the fit check to wait for its GPUs
    # would be cut by the submit's timeout (and fail this test) rather than fail in the expected line.
    args = ["--preset", "smoke", "--train.output_dir", str(tmp_path / "run"),
            "--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "1",
            "--ray.placement_timeout_s", "3600"]  # fmt: skip
    code, log = submit(head, {"excludes": EXCLUDES}, args, timeout=300)
    assert code != 0 and re.search(r"Job '\S+' failed", log), log[-4000:]
    errors = {line for line in log.splitlines() if line.startswith("error: ")}  # Ray repeats the job's last lines
    assert errors == {
        "error: the run does not fit the Ray cluster: needs 2 GPUs, the cluster has 0 free: rollout 1 "
        "(--rollout.num_engines x --rollout.num_gpus_per_engine), policy 1 (--actor.num_workers x "
        "--actor.num_gpus_per_worker)"
    }, log[-3000:]
