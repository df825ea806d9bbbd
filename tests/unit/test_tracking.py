"""The tracker keeps training and its metrics file going when W&B fails (a real offline W&B run; only its `log`
is made to fail, as it does when W&B's service process has ended)."""

import json

import pytest

from entropy_openrlhf.pipeline.tracking import Tracker


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    t = Tracker("test", "tracking", {"a": 1}, str(tmp_path))
    yield t
    if not t._jsonl.closed:
        t.finish()


def test_a_w_and_b_failure_is_said_once_and_every_step_still_reaches_the_metrics_file(tracker, monkeypatch, capsys):
    tracker.log({"x": 1.0}, step=0)
    calls = []

    def lost(payload, step):
        calls.append(step)
        raise ConnectionResetError("Connection lost")

    monkeypatch.setattr(tracker.run, "log", lost)
    tracker.log({"x": 2.0}, step=1)
    tracker.log({"x": 3.0}, step=2)  # W&B is not asked again
    tracker.log_samples([], step=2)
    assert calls == [1]
    out = capsys.readouterr().out
    assert out.count("W&B logging failed") == 1
    assert "at step 1 (ConnectionResetError: Connection lost)" in out and str(tracker.jsonl_path) in out
    finished, real_finish = [], tracker.run.finish
    monkeypatch.setattr(tracker.run, "finish", lambda: finished.append(True))
    tracker.finish()  # closes the file; a broken W&B run is not finished (that would raise again)
    assert finished == []
    real_finish()  # this W&B run is not broken: end it, or the next test's wandb.init would get it back
    rows = [json.loads(line) for line in tracker.jsonl_path.read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_a_healthy_run_logs_to_both_and_finishes(tracker, monkeypatch):
    seen = []
    real_log = tracker.run.log
    monkeypatch.setattr(tracker.run, "log", lambda payload, step: (seen.append(step), real_log(payload, step=step)))
    tracker.log({"x": 1.0}, step=0)
    tracker.log({"x": 2.0}, step=1)
    assert seen == [0, 1] and tracker.wandb_failed == ""
    tracker.finish()
    assert [json.loads(line)["step"] for line in tracker.jsonl_path.read_text().splitlines()] == [0, 1]
