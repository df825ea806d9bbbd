"""W&B logging (online with WANDB_API_KEY, offline otherwise) plus a JSON-lines copy of every logged step.

wandb 0.31 cannot read its own run file back from Python, so `files/metrics.jsonl` in the run folder is what
`scripts/fit_entropy_law.py` and the tests read.

A W&B failure does not stop training: the first one is reported in one line, W&B is left alone from then on, and
every step still goes to metrics.jsonl. The usual cause is W&B's service process ending before the driver: a SIGTERM
to the driver's process group (`ray job stop`, SLURM) reaches both, and the driver's next `log` would otherwise
raise ConnectionResetError before its own stop handler runs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import wandb

from entropy_openrlhf.samples import Sample


class Tracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], output_dir: str):
        mode = "online" if os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "offline" else "offline"
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run_name,
            config=config,
            dir=os.environ.get("WANDB_DIR", output_dir),
            mode=mode,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>
        self.jsonl_path = Path(self.run.dir) / "metrics.jsonl"
        self._jsonl = open(self.jsonl_path, "a")
        self._wandb = wandb
        self.wandb_failed = ""  # the first W&B error, once there was one; W&B is not called after it

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")  # first: it must not depend on W&B
        self._jsonl.flush()
        self._to_wandb(metrics, step)

    def log_samples(self, samples: list[Sample], step: int, limit: int = 8) -> None:
        table = self._wandb.Table(columns=["step", "prompt", "response", "label", "reward", "policy_version"])
        for s in samples[:limit]:
            table.add_data(step, s.prompt[-500:], s.response, s.label, s.reward, s.policy_version)
        self._to_wandb({"samples": table}, step)

    def _to_wandb(self, payload: dict[str, Any], step: int) -> None:
        if self.wandb_failed:
            return
        try:
            self.run.log(payload, step=step)
        except Exception as e:  # any W&B error: its service gone, a full disk, a rejected value
            self.wandb_failed = f"{type(e).__name__}: {e}"
            print(
                f"[entropy-openrlhf] W&B logging failed at step {step} ({self.wandb_failed}); it is not called again "
                f"in this run, which goes on, each step still written to {self.jsonl_path}",
                flush=True,
            )

    def finish(self) -> None:
        self._jsonl.close()
        if not self.wandb_failed:
            self.run.finish()


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
