"""How responses are scored: the `--reward.*` flags (the verifier and its worker actors) and the `--eval.*` flags
(evaluation on the test prompts: schedule, samples, intervals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from entropy_openrlhf.config.base import _CUSTOM_HELP, Section, _custom_resource_errors, _failed, _ray_amount_errors
from entropy_openrlhf.options import option as _f  # short: every field below uses it


@dataclass
class RewardConfig(Section):
    verifier: str = _f(
        "math", "built-in name (math), pkg.module:function, path/file.py:function or an OpenRLHF reward_func .py"
    )
    num_workers: int = _f(2, "verifier worker actors")
    timeout_s: float = _f(5.0, "per-sample verifier deadline; a timeout scores 0")
    max_failed_steps: int = _f(
        3, "stop after this many consecutive steps in which the verifier raised or timed out on every response "
        "(reward/scored_frac 0): a verifier broken for real responses would otherwise train on all-zero rewards "
        "(0 = never stop)",
    )  # fmt: skip
    num_cpus_per_worker: float = _f(0.25, "Ray CPUs per verifier worker")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="verifier worker", example='{"cpu_pool": 1}'))
    overlong_buffer_len: int = _f(
        0, "DAPO's soft overlong penalty: a response longer than --rollout.max_new_tokens minus this many tokens "
        "loses up to --reward.overlong_penalty_factor, linearly, added to its reward in training (0 = off)",
    )  # fmt: skip
    overlong_penalty_factor: float = _f(1.0, "the overlong penalty at the token limit itself (DAPO: 1)")

    def checks(self) -> list[str]:
        return (
            _ray_amount_errors(self, "reward", "num_cpus_per_worker")
            + _failed(
                (self.num_workers >= 1, "reward.num_workers", "must be >= 1"),
                (0 < self.timeout_s < math.inf, "reward.timeout_s", f"{self.timeout_s:g} must be > 0 and finite"),
                (self.max_failed_steps >= 0, "reward.max_failed_steps", "must be >= 0 (0 = never stop)"),
                (self.overlong_buffer_len >= 0, "reward.overlong_buffer_len", "must be >= 0 (0 = off)"),
                (self.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", "must be >= 0"),
            )
            + _custom_resource_errors(self.custom_resources, "reward")
        )


@dataclass
class EvalConfig(Section):
    every: int = _f(0, "evaluate on data.test every N steps and on the final weights (0 = off)")
    max_samples: int = _f(64, "rows used from each test set (0 = all; scripts/evaluate.py defaults to all)")
    n_samples: int = _f(
        1,
        "responses sampled per prompt at eval.temperature. aime/aime25/amc sources: their acc is avg@n (the "
        "paper's protocol); every source, when > 1: pass@k for k = 1, 2, 4, ... n, maj@n and 95% bootstrap "
        "intervals of pass@1 and pass@n (other sources' acc stays greedy)",
    )
    temperature: float = _f(0.6, "sampling temperature of the eval.n_samples responses (the paper's 0.6)")
    bootstrap: int = _f(1000, "bootstrap resamples of the prompts for the 95% intervals of pass@1 and pass@n")
    initial: bool = _f(
        True, "also evaluate the starting weights (version 0); false when the base model is evaluated once apart"
    )
    output_json: str = _f("", "scripts/evaluate.py: also write every metric to this JSON file")

    def checks(self) -> list[str]:
        return _failed(
            (self.n_samples >= 1, "eval.n_samples", f"{self.n_samples} must be >= 1"),
            (self.max_samples >= 0, "eval.max_samples", f"{self.max_samples} must be >= 0 (0 = all)"),
            (self.every >= 0, "eval.every", f"{self.every} must be >= 0 (0 = off)"),
            (self.temperature > 0, "eval.temperature", "must be > 0 (greedy accuracy is reported anyway)"),
            (self.bootstrap >= 100, "eval.bootstrap", f"{self.bootstrap}: at least 100 resamples for a 95% interval"),
        )
