"""Where the run reports and runs: the `--logger.*` flags (W&B, TensorBoard, MLflow, metrics.jsonl) and the `--ray.*`
flags (the local Ray cluster and the deadlines of placing and starting actor groups).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from entropy_openrlhf.config.base import Section, _failed
from entropy_openrlhf.options import option as _f  # short: every field below uses it

# Each backend of --logger.backends: the module it imports and the pip requirement that brings it (pinned in
# requirements.txt), for the optional ones. Kept here, free of those imports, so that a bad name or a missing
# package is refused with the other config errors, before Ray starts; pipeline/loggers.py holds the classes under
# the same names.
LOGGER_BACKENDS: dict[str, tuple[str, str] | None] = {
    "wandb": None,  # the default: part of the core stack, which the driver imports before its config is checked
    "tensorboard": ("tensorboard", "tensorboard==2.21.0"),
    "mlflow": ("mlflow", "mlflow-skinny==3.17.2"),
    "jsonl": None,  # the standard library's json: always there
}


def backend_names(spec: str) -> list[str]:
    """The names of a --logger.backends value ("wandb, tensorboard"), in order, each once."""
    names = [n.strip().lower() for n in spec.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def backend_errors(spec: str) -> list[str]:
    """ "--logger.backends: why" for each name that is not a backend or whose package is not installed."""
    names, known = backend_names(spec), " | ".join(LOGGER_BACKENDS)
    if not names:
        return [f"--logger.backends: {spec!r} names no backend: give one or more of {known}"]
    errors = []
    for name in names:
        if name not in LOGGER_BACKENDS:
            errors.append(f"--logger.backends: {name!r} is not a backend: {known}")
        elif (needs := LOGGER_BACKENDS[name]) and importlib.util.find_spec(needs[0]) is None:
            errors.append(f"--logger.backends: {name} needs the Python package {needs[0]}, which is not installed "
                          f"here: pip install {needs[1]} (requirements.txt pins it), or leave {name} out")  # fmt: skip
    return errors


@dataclass
class LoggerConfig(Section):
    wandb_project: str = _f(
        "entropy-openrlhf", "W&B project and MLflow experiment; W&B is online when WANDB_API_KEY is set, else offline"
    )
    run_name: str = _f("", "run name in W&B and MLflow (default: pipeline and time)")
    backends: str = _f(
        "wandb,jsonl",
        "where metrics go, comma-separated: wandb | tensorboard (<output_dir>/tensorboard) | mlflow "
        "(MLFLOW_TRACKING_URI, else <output_dir>/mlruns) | jsonl; <output_dir>/metrics.jsonl is written whatever "
        "is named",
    )
    sample_table_every: int = _f(5, "log a table of sample responses every N steps (0 = never)")

    def checks(self) -> list[str]:
        return backend_errors(self.backends) + _failed(
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
