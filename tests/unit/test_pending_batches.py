"""What a checkpoint keeps of an asynchronous run's pending work, and what a resume trains from it.

At the save after S steps, the batches for steps S .. S + max_staleness - 1 were generated (or are being generated)
by weights older than the checkpoint's: the save takes them from the producer's queue and writes them, with the
evaluations of older weights not yet logged; a resume trains them first, before anything the producer generates
from the checkpoint's weights, and continues the prompt stream after them. The policy and the weight sync are
stand-ins (the checkpoint's DeepSpeed files are not written here); tests/integration/test_resume.py does it for real.
"""

import json
import threading

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.batches import Batch
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.samples import Sample


class Policy:
    def call_all(self, method, *args, **deadline):
        return [None]


class Sync:
    def __init__(self):
        self.published = []

    def publish(self, version):
        self.published.append(version)


def batch(step: int, versions: list[int], offset: int) -> Batch:
    group = [
        Sample(step, "p", [1, 2], "r", [3, 4], [-0.5, -0.25], "7", v, reward=0.1 * v, ref_log_probs=[-0.125, -1.5])
        for v in versions
    ]
    return Batch(step, [group], {"reward/mean": 0.5}, (0, offset))


def trainer(tmp_path, *flags: str) -> Trainer:
    cfg = from_args(["--train.output_dir", str(tmp_path), "--train.num_steps", "10", *flags])
    t = Trainer(cfg, "unused", [], [])
    t.policy, t.sync = Policy(), Sync()
    return t


def saved(tmp_path, *items) -> tuple[Trainer, list]:
    """A run two versions behind, saved after step 3 (version 4) with `items` in the producer's queue."""
    t = trainer(tmp_path, "--async.max_staleness", "2")
    for item in items:
        t.queue.put(item)
    t.eval_results = [(3, {"eval/acc": 0.25}), (4, {"eval/acc": 0.5})]  # version 4's the resumed run evaluates
    producer = threading.Thread(target=lambda: None)  # only asked whether it is alive when the queue is empty
    t.save(4, (0, 8), producer)
    return t, items


def test_a_save_keeps_the_pending_batches_and_a_resume_trains_them_first(tmp_path):
    four, five = batch(4, [2, 3], offset=12), batch(5, [3, 3], offset=16)
    t, _ = saved(tmp_path, four, five)
    assert list(t.carried) == [four, five]  # this run trains them next, as it would have from the queue
    state = json.loads((tmp_path / "checkpoints" / "step4" / "trainer_state.json").read_text())
    assert (state["step"], state["stream_offset"], state["pending_batches"]) == (4, 8, 2)

    resumed = trainer(tmp_path, "--async.max_staleness", "2")
    assert resumed.resume() == 4
    assert list(resumed.carried) == [four, five]  # the same samples: versions, rewards, log-probs
    assert (resumed.stream.epoch, resumed.stream.offset) == (0, 16)  # after the last pending batch
    assert resumed.eval_results == [(3, {"eval/acc": 0.25})]
    assert resumed.sync.published == [4]


def test_a_resume_generates_again_what_its_settings_do_not_take(tmp_path):
    four, five = batch(4, [3, 3], offset=12), batch(5, [3, 3], offset=16)
    saved(tmp_path, four, five)
    # one version behind, step 5's batch of version 3 is too old: it is generated again from the stream after step 4's
    closer = trainer(tmp_path, "--async.max_staleness", "1")
    closer.resume()
    assert list(closer.carried) == [four]
    assert (closer.stream.epoch, closer.stream.offset) == (0, 12)
    # the streaming producer takes none: it continues the stream from the checkpoint's step
    streaming = trainer(tmp_path, "--async.max_staleness", "2", "--rollout.mode", "stream")
    streaming.resume()
    assert list(streaming.carried) == []
    assert (streaming.stream.epoch, streaming.stream.offset) == (0, 8)


def test_a_producer_failure_met_at_the_save_is_kept_for_its_step(tmp_path):
    four, failure = batch(4, [3, 3], offset=12), RuntimeError("rollout producer failed: engine 0")
    t, _ = saved(tmp_path, four, failure)
    assert list(t.carried) == [four, failure]  # raised when step 5 takes it
    state = json.loads((tmp_path / "checkpoints" / "step4" / "trainer_state.json").read_text())
    assert state["pending_batches"] == 1


def test_a_synchronous_run_has_nothing_pending(tmp_path):
    t = trainer(tmp_path, "--async.max_staleness", "0")
    t.save(4, (0, 8), threading.Thread(target=lambda: None))
    assert not (tmp_path / "checkpoints" / "step4" / "pending.pkl").exists()
    assert json.loads((tmp_path / "checkpoints" / "step4" / "trainer_state.json").read_text())["pending_batches"] == 0
    resumed = trainer(tmp_path, "--async.max_staleness", "0")
    assert resumed.resume() == 4 and not resumed.carried
    assert (resumed.stream.epoch, resumed.stream.offset) == (0, 8)
