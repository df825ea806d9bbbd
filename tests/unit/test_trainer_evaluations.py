"""The trainer's evaluation bookkeeping (pipeline/trainer.py `_maybe_evaluate`, `_take_evaluations`), on stand-in
engines: the version logged is the version evaluated even while a sync changes the weights, each version is
evaluated once however many batches its weights generate, and two evaluations finished within one step both reach
the log."""

import threading
import time
from types import SimpleNamespace

import pytest

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline import trainer as trainer_module
from entropy_openrlhf.pipeline.trainer import Trainer


class Sync:
    """The weight sync as the producer sees it: the engines' version, changed under `engine_lock`."""

    def __init__(self, version: int):
        self.engine_version = version
        self.engine_lock = threading.Lock()

    def make_current(self) -> float:
        return 0.0


@pytest.fixture
def trainer(monkeypatch) -> Trainer:
    t = object.__new__(Trainer)
    t.cfg = from_args(["--eval.every", "1", "--eval.initial", "true"])
    t.test_items = ["a test prompt"]
    t.sync = Sync(4)
    t.latest_version = 4
    t.eval_results, t.evaluated, t._eval_lock = [], set(), threading.Lock()
    t.seen: list[int] = []  # the engines' version each evaluation ran on

    def evaluate(rollout, reward, items, cfg):
        t.seen.append(t.sync.engine_version)
        return {"eval/acc": 0.5}

    monkeypatch.setattr(trainer_module, "evaluate", evaluate)
    t.rollout = t.reward = SimpleNamespace()
    t.rollout_fn = lambda engines, request: []  # evaluation goes through it; the stand-in evaluate never calls it
    return t


def test_the_version_logged_is_the_version_evaluated_while_a_sync_changes_the_weights(trainer):
    trainer.sync.engine_lock.acquire()  # a broadcast of version 5 under way on the trainer thread
    producer = threading.Thread(target=trainer._maybe_evaluate)
    producer.start()
    time.sleep(0.5)  # the producer reaches the evaluation while the weights are changing
    trainer.sync.engine_version = 5
    trainer.sync.engine_lock.release()
    producer.join(timeout=30)
    assert not producer.is_alive()
    assert trainer.seen == [5]
    assert [e["eval/policy_version"] for e in trainer._take_evaluations()] == [5.0]


def test_each_version_is_evaluated_once_even_after_its_result_was_logged(trainer):
    trainer._maybe_evaluate()
    assert len(trainer._take_evaluations()) == 1  # logged with a step: the pending list is empty again
    trainer._maybe_evaluate()  # the next batch was generated with the same weights
    assert trainer.seen == [4] and trainer._take_evaluations() == []
    trainer.sync.engine_version = 5
    trainer._maybe_evaluate()
    assert trainer.seen == [4, 5]


def test_two_evaluations_within_one_step_are_both_handed_over_oldest_first(trainer):
    trainer._maybe_evaluate()
    trainer.sync.engine_version = trainer.latest_version = 5
    trainer._maybe_evaluate(final=True)
    assert [e["eval/policy_version"] for e in trainer._take_evaluations()] == [4.0, 5.0]
