"""The sandbox worker: one Ray actor process that runs tool calls in the sandbox (sandbox.py), one at a time, on
its node. The driver's handle to a pool of them is pool.py.

Nothing here needs torch, vLLM or the config: the process is small, and what the code it runs does stays in the
sandbox's own processes, which die with the call (or with this actor: bwrap's --die-with-parent).
"""

from __future__ import annotations

import ray

from entropy_openrlhf.tools.sandbox import SandboxResult, run_python, sandbox_available


@ray.remote(max_restarts=0, max_task_retries=0)  # a worker that fails is replaced by the pool, which knows the call
class SandboxWorker:
    def __init__(self, settings: dict):
        # run_python's keyword arguments: sandbox, timeout_s, memory_mb, max_output_bytes, max_processes
        self.settings = dict(settings)

    def ready(self) -> str | None:
        """None when this node can run the sandbox, else why not (the pool refuses to start: fail closed). Runs
        the sandbox's probe once in this process."""
        if self.settings.get("sandbox", "bwrap") == "none":
            return None
        return sandbox_available()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        return run_python(code, stdin=stdin, **self.settings)
