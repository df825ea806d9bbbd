"""The `--tools.*` flags: the sandbox that runs a model's tool calls (entropy_openrlhf/tools/sandbox.py), the Ray
pool of sandbox workers that runs them (tools/pool.py), and the limits of a multi-turn tool episode
(docs/guides/tools.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from entropy_openrlhf.config.base import _CUSTOM_HELP, Section, _custom_resource_errors, _failed, _ray_amount_errors
from entropy_openrlhf.options import option as _f  # short: every field below uses it
from entropy_openrlhf.tools.sandbox import SANDBOX_MODES

# the rollout functions (--rollout.function) that run tool calls in the sandbox pool: a run with one of them checks
# the sandbox before any actor starts and reserves the --tools.num_workers workers
TOOL_ROLLOUTS = ("python_tool",)


@dataclass
class ToolsConfig(Section):
    sandbox: str = _f(
        "bwrap",
        "where tool calls run: bwrap (bubblewrap: no network, read-only root, fresh tmpfs work dir, empty env, "
        "rlimits; a run refuses to start where it cannot) | none (a plain subprocess with the rlimits and the "
        "timeout but no isolation, with a loud warning): {choices} (docs/guides/tools.md)",
        choices=SANDBOX_MODES,
    )
    num_workers: int = _f(2, "sandbox worker actors: tool calls that run at once")
    num_cpus_per_worker: float = _f(0.5, "Ray CPUs per sandbox worker")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="sandbox worker", example='{"cpu_pool": 1}'))
    timeout_s: float = _f(
        5.0, "wall-clock limit of one tool call (about as many CPU seconds too); past it the sandbox is killed and "
        "the episode gets a timed-out observation",
    )  # fmt: skip
    memory_mb: int = _f(512, "address space of one tool call, MiB; an allocation past it raises MemoryError")
    max_processes: int = _f(32, "processes and threads one tool call may have at once (a fork bomb stops there)")
    max_output_bytes: int = _f(
        4096, "bytes of stdout, and of stderr, a tool call keeps; past them it is killed and its output marked "
        "truncated",
    )  # fmt: skip
    max_turns: int = _f(4, "tool calls an episode may make before its last generation")
    max_total_tokens: int = _f(
        0, "tokens an episode's response may hold in all, the policy's and the tool turns' together "
        "(0 = --rollout.max_new_tokens)",
    )  # fmt: skip
    error_penalty: float = _f(
        0.0, "subtracted from an episode's reward once per tool call that failed (non-zero exit, timeout or "
        "truncation); 0 = off",
    )  # fmt: skip
    post_tool_tokens: int = _f(
        16, "entropy/post_tool_token_mean: the entropy of the first this many policy tokens after each tool output"
    )

    def checks(self) -> list[str]:
        return (
            _ray_amount_errors(self, "tools", "num_cpus_per_worker")
            + _failed(
                (self.num_workers >= 1, "tools.num_workers", f"{self.num_workers} must be >= 1"),
                (0 < self.timeout_s < math.inf, "tools.timeout_s", f"{self.timeout_s:g} must be > 0 and finite"),
                (self.memory_mb >= 32, "tools.memory_mb", f"{self.memory_mb}: an interpreter needs at least 32 MiB"),
                (
                    self.max_processes >= 2,
                    "tools.max_processes",
                    f"{self.max_processes} must be >= 2 (the sandbox's own init is one of them)",
                ),
                (self.max_output_bytes >= 1, "tools.max_output_bytes", f"{self.max_output_bytes} must be >= 1"),
                (self.max_turns >= 1, "tools.max_turns", f"{self.max_turns} must be >= 1"),
                (
                    self.max_total_tokens >= 0,
                    "tools.max_total_tokens",
                    f"{self.max_total_tokens} must be >= 0 (0 = --rollout.max_new_tokens)",
                ),
                (
                    0 <= self.error_penalty < math.inf,
                    "tools.error_penalty",
                    f"{self.error_penalty:g} must be >= 0 and finite (0 = off)",
                ),
                (self.post_tool_tokens >= 1, "tools.post_tool_tokens", f"{self.post_tool_tokens} must be >= 1"),
            )
            + _custom_resource_errors(self.custom_resources, "tools")
        )
