"""Where the run reports and runs: the `--logger.*` flags (W&B) and the `--ray.*` flags (the local Ray cluster and the
deadlines of placing and starting actor groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.config.base import Section, _failed
from entropy_openrlhf.options import option as _f  # short: every field below uses it


@dataclass
class LoggerConfig(Section):
    wandb_project: str = _f("entropy-openrlhf", "W&B project; online when WANDB_API_KEY is set, else offline")
    run_name: str = _f("", "W&B run name (default: pipeline and time)")
    sample_table_every: int = _f(5, "log a table of sample responses every N steps (0 = never)")

    def checks(self) -> list[str]:
        return _failed(
            (self.sample_table_every >= 0, "logger.sample_table_every", f"{self.sample_table_every} must be >= 0")
        )


@dataclass
class RayConfig(Section):
    num_cpus: int = _f(16, "logical CPUs of a local Ray cluster (actors share the real cores)")
    placement_timeout_s: float = _f(
        300.0, "a group whose placement group the cluster cannot place within this many seconds fails, naming it"
    )
    start_timeout_s: float = _f(
        1800.0, "an actor group that has not started (model loaded, ranks met) within this many seconds fails"
    )

    def checks(self) -> list[str]:
        return _failed(
            (self.num_cpus >= 1, "ray.num_cpus", f"{self.num_cpus} must be >= 1"),
            (self.placement_timeout_s > 0, "ray.placement_timeout_s", "must be > 0"),
            (self.start_timeout_s > 0, "ray.start_timeout_s", "must be > 0"),
        )
