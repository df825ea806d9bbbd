"""`ray job submit` of pipelines/kl_cov.py on a tiny model for 2 steps, against a Ray head on 127.0.0.1."""

import json
import os
import re
import socket
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[2]


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


def test_ray_job_submit_kl_cov_smoke_succeeds(tmp_path):
    head = tempfile.mkdtemp(prefix="eor_e2e_", dir="/tmp")
    held = hold_default_agent_port()  # the head must not depend on that port being free
    dash, gcs = "8275", "6395"
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    subprocess.run(["bash", "scripts/ray_head.sh", "start", head, dash, gcs], cwd=ROOT, check=True, env=env)
    try:
        out_dir = tmp_path / "run"
        proc = subprocess.run(
            [
                str(ROOT / ".venv/bin/ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}",
                "--working-dir", ".", "--runtime-env-json",
                json.dumps({"excludes": [".venv*", "outputs", "wandb", ".git"]}), "--",
                "python", "pipelines/kl_cov.py", "--preset", "smoke", "--train.output_dir", str(out_dir),
            ],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-4000:]
        assert re.search(r"Job '\S+' succeeded", log), log[-4000:]
        assert "first step mean reward" in log
        assert (out_dir / "final" / "config.json").exists()
        runs = list((out_dir / "wandb").glob("offline-run-*/files/metrics.jsonl"))
        assert runs and len(runs[0].read_text().splitlines()) == 2
    finally:
        subprocess.run(["bash", "scripts/ray_head.sh", "stop", head], cwd=ROOT, env=env)
        if held:
            held.close()
    assert subprocess.run(["pgrep", "-f", head], capture_output=True).returncode == 1  # nothing of it left
