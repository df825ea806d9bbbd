"""The tracker and its backends, each read back with its own library: metrics.jsonl, TensorBoard's event reader (the
one TensorBoard's server uses), the MLflow client on the local file store; W&B as a real offline run, whose file
wandb 0.31 cannot read back, so its tests check what the tracker does when W&B fails.

Bad --logger.backends input is refused through the real entry point, before Ray starts."""

import json
import math
import sys

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from entropy_openrlhf.config import ConfigError
from entropy_openrlhf.config.sections.logger_ray import LOGGER_BACKENDS
from entropy_openrlhf.pipeline.loggers import BACKENDS, markdown_table, mlflow_name
from entropy_openrlhf.pipeline.tracking import Tracker
from entropy_openrlhf.samples import Sample

LOCAL = ("tensorboard", "mlflow", "jsonl")  # every backend that can be read back here


@pytest.fixture(autouse=True)
def local_loggers(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def tracker(tmp_path):
    t = Tracker("test", "tracking", {"a": 1}, str(tmp_path))
    yield t
    t.finish()  # once finished, a no-op


def sample(i: int, response: str) -> Sample:
    return Sample(prompt_index=i, prompt=f"prompt {i}", prompt_token_ids=[1], response=response,
                  response_token_ids=[2], rollout_log_probs=[0.0], label=str(i), policy_version=3)  # fmt: skip


def jsonl_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tensorboard_values(out) -> tuple[dict[str, list], dict[str, list]]:
    """{tag: [(step, value), ...]} of the scalars and {tag: [(step, text), ...]} of the text TensorBoard would show,
    in the order logged (what is left after its purge of steps a resumed run logged again)."""
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    scalars, texts = {}, {}
    for tag in acc.Tags()["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        for event in acc.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            if plugin == "scalars":
                scalars.setdefault(tag, []).append((event.step, float(value)))
            else:
                texts.setdefault(tag, []).append((event.step, value.item().decode()))
    return scalars, texts


def mlflow_runs(uri: str, experiment: str = "test") -> tuple[MlflowClient, list]:
    client = MlflowClient(tracking_uri=uri)
    [found] = [e for e in client.search_experiments() if e.name == experiment]
    return client, client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Two (step, value) series alike, NaN equal to NaN."""
    return len(a) == len(b) and all(
        sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb))) for (sa, va), (sb, vb) in zip(a, b)
    )


def assert_loggers_agree(out, experiment: str = "test") -> None:
    """TensorBoard's and the (last) MLflow run's metrics are metrics.jsonl's: every number under the same name (MLflow's
    spelling of it), at the same steps in the same order, with the same value; what is not a number is in neither."""
    series, others = {}, set()
    for row in jsonl_rows(out):
        for key, value in row.items():
            if key == "step":
                continue
            if isinstance(value, (int, float)):
                series.setdefault(key, []).append((row["step"], float(value)))
            else:
                others.add(key)
    scalars, _ = tensorboard_values(out)
    assert set(scalars) == set(series) and not others & set(scalars)
    client, runs = mlflow_runs((out / "mlruns").as_uri(), experiment)
    run_id = runs[-1].info.run_id
    assert set(runs[-1].data.metrics) == {mlflow_name(k) for k in series}
    for key, want in series.items():
        assert same(scalars[key], want), (key, scalars[key], want)  # exact: written as float64
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, mlflow_name(key))]
        assert same(history, want), (key, history, want)


def test_every_backend_holds_the_metrics_jsonl_holds_step_by_step(tmp_path, capsys):
    steps = {
        0: {"reward/mean": 0.1 + 0.2, "eval/pass@4": 0.75, "train/skipped_steps": 0, "eval/x/correct_counts": [0, 3]},
        1: {"reward/mean": float("nan"), "eval/pass@4": 1e-300, "train/skipped_steps": 2, "time/step": 12.5},
    }
    tracker = Tracker("test", "local", {"loss.type": "kl_cov", "train.seed": 42}, str(tmp_path), backends=LOCAL)
    for step, metrics in steps.items():
        tracker.log(metrics, step)
    tracker.log_samples([sample(0, "two\nlines | a pipe"), sample(1, "42")], step=1)
    tracker.finish()
    out = capsys.readouterr().out
    assert out.count("left out of TensorBoard and MLflow") == 1 and "eval/x/correct_counts" in out  # said once

    rows = jsonl_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["eval/x/correct_counts"] == [0, 3]  # lists kept
    assert_loggers_agree(tmp_path)
    scalars, texts = tensorboard_values(tmp_path)
    assert "eval/x/correct_counts" not in scalars and scalars["eval/pass@4"] == [(0, 0.75), (1, 1e-300)]
    client, [run] = mlflow_runs((tmp_path / "mlruns").as_uri())
    assert run.info.status == "FINISHED" and run.info.run_name == "local"
    assert run.data.params == {"loss.type": "kl_cov", "train.seed": "42"}
    assert run.data.metrics["eval/pass_at_4"] == 1e-300 and "eval/x/correct_counts" not in run.data.metrics

    # the sample table, as markdown in both: a header, its rule, one line per sample
    want = markdown_table(
        ["step", "prompt", "response", "label", "reward", "policy_version"],
        [[1, "prompt 0", "two\nlines | a pipe", "0", 0.0, 3], [1, "prompt 1", "42", "1", 0.0, 3]],
    )
    assert texts["samples/text_summary"] == [(1, want)]
    assert len(want.splitlines()) == 4 and "two<br>lines \\| a pipe" in want
    artifact = client.download_artifacts(run.info.run_id, "samples/step_000001.md", str(tmp_path / "dl"))
    assert open(artifact).read() == want
    config = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path / "dl"))
    assert json.loads(open(config).read()) == {"loss.type": "kl_cov", "train.seed": 42}


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path, capsys):
    """A resume redoes the steps after its checkpoint: metrics.jsonl and TensorBoard then hold the resumed run's
    rows for them, the earlier run's kept in metrics.replaced.jsonl; MLflow has one run per start."""
    first = Tracker("test", "first", {}, str(tmp_path), backends=LOCAL)
    for step in range(4):
        first.log({"x": float(step)}, step)
    first.finish()  # killed after step 3, its newest checkpoint at step 2
    resumed = Tracker("test", "resumed", {}, str(tmp_path), backends=LOCAL)
    for step in (2, 3, 4):
        resumed.log({"x": 10.0 + step}, step)
    resumed.finish()
    assert "the 2 rows an earlier run logged from there on were moved" in capsys.readouterr().out
    want = {0: 0.0, 1: 1.0, 2: 12.0, 3: 13.0, 4: 14.0}
    assert {r["step"]: r["x"] for r in jsonl_rows(tmp_path)} == want and len(jsonl_rows(tmp_path)) == 5
    replaced = [json.loads(x) for x in (tmp_path / "metrics.replaced.jsonl").read_text().splitlines()]
    assert replaced == [{"step": 2, "x": 2.0}, {"step": 3, "x": 3.0}]
    assert tensorboard_values(tmp_path)[0]["x"] == list(want.items())  # each step once: the earlier 2 and 3 purged
    client, runs = mlflow_runs((tmp_path / "mlruns").as_uri())
    assert [r.info.run_name for r in runs] == ["first", "resumed"]
    assert [m.step for m in client.get_metric_history(runs[1].info.run_id, "x")] == [2, 3, 4]


def test_mlflow_goes_to_mlflow_tracking_uri_when_it_is_set(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    tracker = Tracker("test", "remote", {}, str(tmp_path / "out"), backends="mlflow")
    tracker.log({"x": 1.0}, 0)
    tracker.finish()
    assert not (tmp_path / "out" / "mlruns").exists() and (tmp_path / "out" / "metrics.jsonl").exists()
    client, [run] = mlflow_runs(store.as_uri())
    assert [m.value for m in client.get_metric_history(run.info.run_id, "x")] == [1.0]
    assert f"MLflow {store.as_uri()} run {run.info.run_id}" in tracker.where()


def test_a_backend_that_cannot_start_is_a_config_error_and_the_started_ones_are_finished(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://host/x")  # MLflow has no store for this scheme
    with pytest.raises(ConfigError, match=r"^--logger.backends mlflow: MLflow did not start: "):
        Tracker("test", "t", {}, str(tmp_path), backends="wandb,mlflow")
    assert wandb.run is None  # the W&B run started before it was finished, not left open


def test_the_registry_names_what_the_config_accepts():
    assert set(BACKENDS) == set(LOGGER_BACKENDS)
    with pytest.raises(ConfigError, match="'neptune' is not a backend: wandb | tensorboard | mlflow | jsonl"):
        Tracker("test", "t", {}, "/nonexistent", backends=["wandb", "neptune"])


@pytest.mark.parametrize(
    "value, hidden, words",
    [
        ("wandb,neptune", None, ["--logger.backends", "'neptune' is not a backend", "wandb | tensorboard"]),
        (" , ", None, ["--logger.backends", "names no backend"]),
        ("jsonl,mlflow", "mlflow", ["--logger.backends", "mlflow needs the Python package mlflow",
                                    "pip install mlflow-skinny==3.17.2"]),
        ("tensorboard", "tensorboard", ["--logger.backends", "pip install tensorboard==2.21.0"]),
    ],
)  # fmt: skip
def test_bad_backends_exit_2_naming_the_flag_before_ray(value, hidden, words, tmp_path, monkeypatch, capsys):
    import entropy_openrlhf.pipeline.run as run
    from entropy_openrlhf.pipeline.main import main

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a run whose input is bad")

    monkeypatch.setattr(run, "init_ray", refuse)
    if hidden:
        monkeypatch.setitem(sys.modules, hidden, None)  # what an environment without the package looks like
    code = main(["--train.output_dir", str(tmp_path), "--logger.backends", value], "kl_cov")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: invalid config: --logger.backends") and "\n" not in err, err
    assert all(w in err for w in words), err


def test_a_w_and_b_failure_is_said_once_and_every_step_still_reaches_the_metrics_file(tracker, monkeypatch, capsys):
    wandb_run = tracker.backends["wandb"].run
    tracker.log({"x": 1.0}, step=0)
    calls = []

    def lost(payload, step):
        calls.append(step)
        raise ConnectionResetError("Connection lost")

    monkeypatch.setattr(wandb_run, "log", lost)
    tracker.log({"x": 2.0}, step=1)
    tracker.log({"x": 3.0}, step=2)  # W&B is not asked again
    tracker.log_samples([], step=2)
    assert calls == [1]
    out = capsys.readouterr().out
    assert out.count("W&B logging failed") == 1
    assert "at step 1 (ConnectionResetError: Connection lost)" in out and str(tracker.jsonl_path) in out
    finished, real_finish = [], wandb_run.finish
    monkeypatch.setattr(wandb_run, "finish", lambda: finished.append(True))
    tracker.finish()  # closes the file; a broken W&B run is not finished (that would raise again)
    assert finished == []
    real_finish()  # this W&B run is not broken: end it, or the next test's wandb.init would get it back
    rows = [json.loads(line) for line in tracker.jsonl_path.read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_a_healthy_run_logs_to_both_and_finishes(tracker, tmp_path, monkeypatch):
    wandb_run = tracker.backends["wandb"].run
    seen = []
    real_log = wandb_run.log
    monkeypatch.setattr(wandb_run, "log", lambda payload, step: (seen.append(step), real_log(payload, step=step)))
    tracker.log({"x": 1.0}, step=0)
    tracker.log({"x": 2.0, "counts": [1, 2]}, step=1)  # W&B takes lists as they are
    assert seen == [0, 1] and tracker.wandb_failed == ""
    tracker.finish()
    assert tracker.jsonl_path == tmp_path / "metrics.jsonl"  # the output folder's, not inside W&B's run folder
    assert [json.loads(line)["step"] for line in tracker.jsonl_path.read_text().splitlines()] == [0, 1]
    assert tracker.run_dir.parent == tmp_path / "wandb" and list(tracker.run_dir.glob("*.wandb"))
    assert tracker.where().startswith(f"metrics {tmp_path / 'metrics.jsonl'}; W&B run {tracker.run_dir}")
