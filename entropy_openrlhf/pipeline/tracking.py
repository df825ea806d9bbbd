"""W&B logging (online with WANDB_API_KEY, offline otherwise) plus a JSON-lines copy of every logged step.

wandb 0.31 cannot read its own run file back from Python, so `files/metrics.jsonl` in the run folder is what
`scripts/fit_entropy_law.py` and the tests read.
"""

from __future__ import annotations

import json
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
        self._jsonl = open(Path(self.run.dir) / "metrics.jsonl", "a")
        self._wandb = wandb

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()

    def log_samples(self, samples: list[Sample], step: int, limit: int = 8) -> None:
        table = self._wandb.Table(columns=["step", "prompt", "response", "label", "reward", "policy_version"])
        for s in samples[:limit]:
            table.add_data(step, s.prompt[-500:], s.response, s.label, s.reward, s.policy_version)
        self.run.log({"samples": table}, step=step)

    def finish(self) -> None:
        self._jsonl.close()
        self.run.finish()
