"""The tracker's backends, one class per name of `--logger.backends`, behind one interface (`Backend`): a step's
metrics, a table of rows at a step, the end of the run. `Tracker` (tracking.py) builds them by name from `BACKENDS`.

Where each writes, under the run's output folder:
- jsonl: `metrics.jsonl`, one JSON line per logged row, every value as logged (lists included). Always on: the
  study, the scripts and the checks read it. A run that logs a step an earlier run in the folder logged too (a
  resume redoes the steps after its checkpoint) first moves the earlier run's rows from that step on to
  `metrics.replaced.jsonl`, so the file is one history, as TensorBoard's purge below makes its own;
- wandb: `wandb/offline-run-*` (or online, or under `WANDB_DIR`), every value, the table as a W&B Table;
- tensorboard: event files in `tensorboard/`, scalars in double precision, the table as markdown text. Each run
  writes its own event file, marked to purge what earlier files logged from its first step on;
- mlflow: a run of the experiment `--logger.wandb_project` at `MLFLOW_TRACKING_URI`, or in a local file store at
  `mlruns/`; scalars as metrics (names mapped by `mlflow_name`), the config as params and `config.json`, the table as
  a markdown artifact `<key>/step_<N>.md`. Each run (a resume too) is a new MLflow run.

TensorBoard and MLflow keep numbers only: a value that is not a real number (a list of per-prompt counts, say) is
left out there, and `Tracker` says so once per key.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import wandb  # the default backend and part of the core stack (requirements.txt), so imported at the top


def is_scalar(value: Any) -> bool:
    """A value TensorBoard and MLflow can plot: a real number (bools and numpy scalars included)."""
    return isinstance(value, numbers.Real)


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """Rows as a markdown table, one line per row: a cell's `|` escaped and its line breaks written as <br>, so a
    response of several lines stays in its cell (TensorBoard renders the text as markdown)."""

    def cell(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class Backend:
    """One logger. `needs_scalars`: it takes real numbers only (the tracker filters the rest out)."""

    name: ClassVar[str]
    needs_scalars: ClassVar[bool] = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table of rows at `step`; a backend without tables ignores it."""

    def finish(self) -> None:
        """Flush and close; called once, at the end of the run."""

    def where(self) -> str:
        """Where this run's data is, for the driver's start-up line."""
        raise NotImplementedError


def _step_of(line: str) -> float:
    """A metrics.jsonl row's step; a line cut short by a killed run has none and goes with the replaced rows."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class JsonlBackend(Backend):
    name = "jsonl"

    def __init__(self, project: str, run_name: str, config: dict[str, Any], output_dir: str):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.replaced_path = self.path.with_name("metrics.replaced.jsonl")
        self._file = None  # opened at the first row, once the run's first step is known

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._file is None:
            self._open(first_step=step)
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()  # each row on disk as it comes: a killed run keeps every step it logged

    def _open(self, first_step: int) -> None:
        """Append to the folder's file; rows of an earlier run from `first_step` on (the steps a resume redoes)
        are moved to metrics.replaced.jsonl first, so a step's row is the latest run's."""
        if self.path.exists():
            keep, moved = [], []
            for line in self.path.read_text().splitlines():
                if line.strip():
                    (keep if _step_of(line) < first_step else moved).append(line + "\n")
            if moved:
                with open(self.replaced_path, "a") as f:
                    f.writelines(moved)
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(keep))
                os.replace(tmp, self.path)  # whole or not at all: a crash here leaves the old file
                rows = f"{len(moved)} row{'s' if len(moved) != 1 else ''}"
                print(
                    f"[entropy-openrlhf] metrics.jsonl: this run logs from step {first_step}; the {rows} an earlier "
                    f"run logged from there on were moved to {self.replaced_path}",
                    flush=True,
                )
        self._file = open(self.path, "a")

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()

    def where(self) -> str:
        return f"metrics {self.path}"


class WandbBackend(Backend):
    """Online with WANDB_API_KEY (unless WANDB_MODE=offline), offline otherwise: no login or network needed."""

    name = "wandb"

    def __init__(self, project: str, run_name: str, config: dict[str, Any], output_dir: str):
        online = os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "offline"
        self._wandb = wandb
        self.run = wandb.init(
            project=project,
            name=run_name,
            config=config,
            dir=os.environ.get("WANDB_DIR", output_dir),
            mode="online" if online else "offline",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        table = self._wandb.Table(columns=columns)
        for row in rows:
            table.add_data(*row)
        self.run.log({key: table}, step=step)

    def finish(self) -> None:
        self.run.finish()

    def where(self) -> str:
        return f"W&B run {self.run_dir}"


class TensorBoardBackend(Backend):
    name = "tensorboard"
    needs_scalars = True

    def __init__(self, project: str, run_name: str, config: dict[str, Any], output_dir: str):
        # here, not at the top: a run that does not name this backend must not need its package (config checks
        # say which is missing); torch's writer needs the tensorboard package, not TensorFlow
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(output_dir) / "tensorboard"
        self._make_writer = SummaryWriter
        self._config = config
        self._writer = None  # made at the first row: its purge step is the run's first step

    def _at(self, step: int):
        if self._writer is None:
            # purge_step: TensorBoard hides what earlier event files here logged from this step on, the steps a
            # resumed run logs again (as metrics.jsonl does); on a fresh folder there is nothing to hide
            self._writer = self._make_writer(log_dir=str(self.log_dir), purge_step=step)
            self._writer.add_text("config", "```\n" + json.dumps(self._config, indent=1, default=str) + "\n```", step)
        return self._writer

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        writer = self._at(step)
        for key, value in metrics.items():
            # new_style + double_precision: stored as a float64 tensor, the value metrics.jsonl holds, where the
            # classic summary would round it to float32
            writer.add_scalar(key, float(value), step, new_style=True, double_precision=True)
        writer.flush()  # per step, like metrics.jsonl, rather than every two minutes

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        writer = self._at(step)
        writer.add_text(key, markdown_table(columns, rows), step)
        writer.flush()

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def where(self) -> str:
        return f"TensorBoard {self.log_dir}"


_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")  # MLflow takes letters, digits, _ - . space : / in names


def mlflow_name(key: str) -> str:
    """A metric name as MLflow takes it: '@' spelt `_at_` (eval/pass@4 -> eval/pass_at_4), any other character it
    refuses replaced by '_'."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))[:250]


class MlflowBackend(Backend):
    name = "mlflow"
    needs_scalars = True
    BATCH = 1000  # MLflow's limit of metrics per log_batch call (params: 100)

    def __init__(self, project: str, run_name: str, config: dict[str, Any], output_dir: str):
        # here, not at the top: a run that does not name this backend must not need mlflow (nor wait ~1 s for it)
        from mlflow import MlflowClient, entities

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(output_dir).resolve() / "mlruns").as_uri()
        if self.uri.startswith("file:") or "://" not in self.uri:
            # MLflow 3 refuses its file store unless asked for it; a local folder needs no server or database,
            # which is why it is the default here (docs/guides/metrics.md says how to browse it)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._metric, self.client = entities.Metric, MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [entities.Param(mlflow_name(k), str(v)[:6000]) for k, v in config.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + self.BATCH])

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self.client.log_text(self.run_id, markdown_table(columns, rows), f"{mlflow_name(key)}/step_{step:06d}.md")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")

    def where(self) -> str:
        return f"MLflow {self.uri} run {self.run_id}"


BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (WandbBackend, TensorBoardBackend, MlflowBackend, JsonlBackend)
}
