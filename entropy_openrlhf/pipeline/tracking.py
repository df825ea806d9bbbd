"""The Tracker: every logged step to each backend of `--logger.backends` (pipeline/loggers.py), and always to
`<output_dir>/metrics.jsonl`, which the study, `scripts/fit_entropy_law.py` and the tests read.

metrics.jsonl is written first and its errors are raised: it is the run's record. Any other backend's failure does
not stop training: the first is reported in one line, that backend is left alone from then on, and the others go
on. The usual cause is W&B's service process ending before the driver: a SIGTERM to the driver's process group
(`ray job stop`, SLURM) reaches both, and the driver's next `log` would otherwise raise ConnectionResetError before
its own stop handler runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from entropy_openrlhf.config import ConfigError
from entropy_openrlhf.config.sections.logger_ray import backend_errors, backend_names
from entropy_openrlhf.pipeline.loggers import BACKENDS, Backend, JsonlBackend, is_scalar
from entropy_openrlhf.samples import Sample

DEFAULT_BACKENDS = ("wandb", "jsonl")
LABELS = {"wandb": "W&B", "tensorboard": "TensorBoard", "mlflow": "MLflow", "jsonl": "metrics.jsonl"}
SAMPLE_COLUMNS = ["step", "prompt", "response", "label", "reward", "policy_version"]


class Tracker:
    """Built by name: `backends` holds names of `BACKENDS` (what `--logger.backends` lists); jsonl is added when
    left out. A name that is not a backend, or whose package is missing, or a backend that fails to start, raises
    ConfigError naming --logger.backends; the backends already started are finished first."""

    def __init__(
        self,
        project: str,
        run_name: str,
        config: dict[str, Any],
        output_dir: str,
        backends: Sequence[str] | str = DEFAULT_BACKENDS,
    ):
        spec = backends if isinstance(backends, str) else ",".join(backends)
        errors = backend_errors(spec)
        if errors:
            raise ConfigError("; ".join(errors))
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.jsonl = JsonlBackend(project, run_name, config, output_dir)
        self.backends: dict[str, Backend] = {"jsonl": self.jsonl}
        self.failed: dict[str, str] = {}  # name -> its first error; a backend in here is not called again
        self._noted: set[str] = set()  # non-scalar keys already said to be left out of TensorBoard / MLflow
        self.finished = False
        for name in backend_names(spec):
            if name == "jsonl":
                continue
            try:
                self.backends[name] = BACKENDS[name](project, run_name, config, output_dir)
            except Exception as e:  # noqa: BLE001 - said as a config error, whatever the library raised
                self.finish()
                first_line = (str(e).strip().splitlines() or [""])[0]  # bad input is reported in one line
                raise ConfigError(
                    f"--logger.backends {name}: {LABELS[name]} did not start: {type(e).__name__}: {first_line}"
                ) from e

    @property
    def jsonl_path(self) -> Path:
        return self.jsonl.path

    @property
    def run_dir(self) -> Path | None:
        """The W&B run folder, None without W&B."""
        wandb = self.backends.get("wandb")
        return wandb.run_dir if wandb is not None else None

    def where(self) -> str:
        """Where each backend writes, for the driver's lines ("metrics <path>; W&B run <folder>; ...")."""
        return "; ".join(b.where() for b in self.backends.values())

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.jsonl.log(metrics, step)  # first, and never skipped: it must not depend on any other backend
        scalars = {k: v for k, v in metrics.items() if is_scalar(v)}
        scalar_only = [LABELS[n] for n, b in self.backends.items() if b.needs_scalars and n not in self.failed]
        if scalar_only and len(scalars) < len(metrics):
            self._note_non_scalars([k for k in metrics if k not in scalars], scalar_only)
        for name, backend in self.backends.items():
            if name != "jsonl":
                payload = scalars if backend.needs_scalars else metrics
                self._call(name, lambda b=backend, p=payload: b.log(p, step), step)

    def log_samples(self, samples: list[Sample], step: int, limit: int = 8) -> None:
        rows = [[step, s.prompt[-500:], s.response, s.label, s.reward, s.policy_version] for s in samples[:limit]]
        for name, backend in self.backends.items():
            self._call(name, lambda b=backend: b.log_table("samples", SAMPLE_COLUMNS, rows, step), step)

    def _note_non_scalars(self, keys: list[str], labels: list[str]) -> None:
        new = [k for k in keys if k not in self._noted]
        if new:
            self._noted.update(new)
            print(f"[entropy-openrlhf] not numbers, so left out of {' and '.join(labels)} (kept in "
                  f"{self.jsonl_path}): {', '.join(new)}", flush=True)  # fmt: skip

    def _call(self, name: str, call: Callable[[], None], step: int) -> None:
        if name in self.failed:
            return
        try:
            call()
        except Exception as e:  # any backend error: its service gone, a full disk, a rejected value
            if name == "jsonl":
                raise
            self.failed[name] = f"{type(e).__name__}: {e}"
            print(
                f"[entropy-openrlhf] {LABELS[name]} logging failed at step {step} ({self.failed[name]}); it is not "
                f"called again in this run, which goes on, each step still written to {self.jsonl_path}",
                flush=True,
            )

    @property
    def wandb_failed(self) -> str:
        """W&B's first error, "" while it works (or without W&B)."""
        return self.failed.get("wandb", "")

    def finish(self) -> None:
        """Each backend finished, metrics.jsonl last; a backend that failed is not (that would raise again), and
        one whose finish raises is said so in one line while the others still finish. A second call does
        nothing."""
        if self.finished:
            return
        self.finished = True
        for name, backend in sorted(self.backends.items(), key=lambda item: item[0] == "jsonl"):
            if name in self.failed:
                continue
            try:
                backend.finish()
            except Exception as e:  # noqa: BLE001 - the run is over; the other backends still need closing
                if name == "jsonl":
                    raise
                self.failed[name] = f"{type(e).__name__}: {e}"
                print(f"[entropy-openrlhf] finishing {LABELS[name]} failed: {self.failed[name]}", flush=True)


def summarize(history: list[dict[str, float]], startup_s: float) -> str:
    """The end-of-run table `make demo` prints (from the history `Trainer.run` returns)."""
    if not history:
        return "no steps ran"
    first, last = history[0], history[-1]

    def avg(key: str) -> float:
        vals = [h[key] for h in history if key in h and math.isfinite(h[key])]
        return sum(vals) / len(vals) if vals else float("nan")

    rows = [
        ("steps", f"{len(history)}"),
        (
            "reward (first step -> last step)",
            f"{first.get('reward/mean', float('nan')):.3f} -> {last.get('reward/mean', float('nan')):.3f}",
        ),
        (
            "accuracy (first -> last)",
            f"{first.get('reward/acc', float('nan')):.3f} -> {last.get('reward/acc', float('nan')):.3f}",
        ),
        (
            "entropy seq-mean (first -> last)",
            f"{first.get('entropy/seq_mean', float('nan')):.3f} -> {last.get('entropy/seq_mean', float('nan')):.3f}",
        ),
        ("startup seconds", f"{startup_s:.1f}"),
    ]
    for key in (
        "time/rollout",
        "time/reward",
        "time/reference",
        "time/train",
        "time/sync",
        "time/wait_for_rollout",
        "time/step",
    ):
        rows.append((f"{key} (mean s)", f"{avg(key):.2f}"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
