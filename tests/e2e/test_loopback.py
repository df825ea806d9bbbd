"""A local run, started the ways a user starts one, must not listen beyond loopback: its Ray runs with
authentication off (docs/guides/cpu.md). Each test polls the listening sockets of every process the run started while
it runs, from the outside, with psutil. The pipeline itself, `python pipelines/kl_cov.py` from a shell without our
exports, is watched in tests/e2e/test_gpu_preflight.py: the preflight's CPU twin runs it twice there (one pipeline
start fewer than a run of its own here)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from entropy_openrlhf.cluster import exposed_listeners

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
PY = str(ROOT / ".venv" / "bin" / "python")


def plain_env() -> dict[str, str]:
    """A new user's shell: none of the variables the Makefile or tests/conftest.py export (PYTHONPATH, where a shell
    has it, is neither: the run imports the checkout the tests do)."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "TORCH_EXTENSIONS_DIR", "PYTHONPATH")
    return {k: os.environ[k] for k in keep if k in os.environ}


class Watcher:
    """Every `interval` s: the listening sockets of `pid`'s process tree; exposed ones and the names of processes
    that listened at all (evidence that the poll covered the actors' lifetime, not just the start)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.root = psutil.Process(pid)
        self.exposed: set[str] = set()
        self.listening_names: set[str] = set()
        self.polls = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _run(self) -> None:
        while not self._done.is_set():
            tree = self._tree()
            if tree:
                self.exposed.update(exposed_listeners(tree))
                pids = {p.pid: p for p in tree}
                for conn in psutil.net_connections(kind="tcp"):
                    if conn.pid in pids and conn.status == psutil.CONN_LISTEN:
                        try:
                            self.listening_names.add(pids[conn.pid].name())
                        except psutil.Error:
                            pass
                self.polls += 1
            time.sleep(0.25)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)


def run_watched(
    args: list[str], timeout: float, separate_stderr: bool = False
) -> tuple[subprocess.CompletedProcess, Watcher]:
    """`args` run from a plain shell (plain_env) under a Watcher; its stderr in its stdout unless `separate_stderr`."""
    stderr = subprocess.PIPE if separate_stderr else subprocess.STDOUT
    proc = subprocess.Popen(args, cwd=ROOT, env=plain_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    watcher = Watcher(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        watcher.stop()
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, out, err), watcher


def assert_listened_on_loopback_only(watcher: Watcher) -> None:
    """What a watched local pipeline run must show: no socket beyond loopback, while the poll saw Ray's servers and
    the policy rank (its rendezvous store) listen. tests/e2e/test_gpu_preflight.py watches the two local runs of
    `pipelines/kl_cov.py` the GPU preflight's CPU twin makes from a plain shell."""
    assert watcher.exposed == set(), watcher.exposed
    assert {"gcs_server", "raylet"} <= watcher.listening_names, watcher.listening_names
    assert any("PolicyActo" in name for name in watcher.listening_names), watcher.listening_names


IMPORTS_RAY_FIRST = """
import ray  # a launcher that imports Ray before our package: Ray has read its network settings already
import os

from entropy_openrlhf.cluster import init_ray

assert init_ray(2)


@ray.remote(num_cpus=0)
class Actor:
    def where(self):
        return ray.util.get_node_ip_address()


print("node", ray.get(Actor.remote().where.remote()), flush=True)
ray.shutdown()
"""


def test_a_launcher_that_imported_ray_first_still_gets_a_loopback_ray(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(IMPORTS_RAY_FIRST)
    done, watcher = run_watched([PY, str(script)], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "node 127.0.0.1" in done.stdout
    assert watcher.exposed == set(), watcher.exposed
    assert "gcs_server" in watcher.listening_names


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
