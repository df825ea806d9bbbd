"""Tools a model calls during a rollout: `sandbox.py` runs its Python in a hardened local sandbox
(`run_python`, `sandbox_available`, `check_sandbox`); `worker_actor.py` is the Ray actor that does it on a node, and
`pool.py` the driver's pool of them (`ToolPool`, `--tools.num_workers`). docs/guides/tools.md says what the sandbox
guarantees and what it does not.

Only the sandbox is imported here: the config imports this package, and needs no Ray from it.
"""

from entropy_openrlhf.tools.sandbox import (
    SANDBOX_MODES,
    SandboxResult,
    SandboxUnavailableError,
    check_sandbox,
    run_python,
    sandbox_available,
)

__all__ = [
    "SANDBOX_MODES",
    "SandboxResult",
    "SandboxUnavailableError",
    "check_sandbox",
    "run_python",
    "sandbox_available",
]
