"""What a streaming checkpoint records of the prompts drawn but not trained, and what a resume does with them.

`--rollout.mode stream|partial` draws prompts ahead of the trainer: at a save after S steps some are in flight, some
scored in the buffer, some in a batch handed over for a later step. The checkpoint lists them (`open_prompts`) with
the stream position past them; the resumed run rolls them out again before drawing anything new, so over the two
runs every prompt is trained once and none is skipped. The producer's bookkeeping runs here on its own (the engines,
rewards and policy are not involved); tests/integration/test_sigterm.py stops and resumes a partial run for real.
"""

import json
import threading
from types import SimpleNamespace

import pytest

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline import streaming
from entropy_openrlhf.pipeline.streaming import StreamProducer
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.samples import PromptItem, Sample
from tests.unit.test_pending_batches import Policy, Sync

ITEMS = [PromptItem(index=100 + i, prompt=f"q{i}", label=str(i)) for i in range(7)]  # index != position, on purpose


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch):
    # the producer loads the model's tokenizer to tokenise prompts; nothing here is tokenised
    monkeypatch.setattr(streaming.AutoTokenizer, "from_pretrained", lambda path: None)


def trainer(tmp_path, *flags: str, mode: str = "partial") -> Trainer:
    cfg = from_args(
        ["--train.output_dir", str(tmp_path), "--train.num_steps", "10", "--rollout.mode", mode,
         "--rollout.batch_size", "2", "--async.max_staleness", "1", *flags]
    )  # fmt: skip
    t = Trainer(cfg, "unused", ITEMS, [])
    t.policy, t.sync = Policy(), Sync()
    t.start_step = t.latest_version = 0
    return t


def producer(t: Trainer) -> StreamProducer:
    p = StreamProducer(t)
    # what a batch's metrics read of the engines and the rollout group
    p.engines, t.rollout = SimpleNamespace(resubmitted=0, in_flight=lambda: 0), SimpleNamespace(restarts=0)
    return p


def finish(producer: StreamProducer, key: int, item: PromptItem, version: int, rewards=(0.0, 1.0)) -> None:
    """The group of `key` scored and buffered, as `_group` leaves it."""
    group = [Sample(item.index, item.prompt, [1], "r", [2], [-0.5], item.label, version, reward=r) for r in rewards]
    producer.buffer.append((key, group, {"reward/mean": 0.5}))


def positions(drawn) -> list[int]:
    return [ITEMS.index(item) for _, _, item in drawn]


@pytest.mark.parametrize("mode", ["stream", "partial"])  # one producer for both: their syncs differ, not this
def test_a_save_lists_the_prompts_drawn_and_not_trained_and_a_resume_rolls_them_out_first(tmp_path, mode):
    t = trainer(tmp_path, mode=mode)
    p = t.streamer = producer(t)
    drawn = [p._draw() for _ in range(6)]  # 6 of the 7 prompts, in the stream's (shuffled) order
    order = positions(drawn)
    assert sorted(order) == sorted(set(order))  # no prompt drawn twice within an epoch
    for k in (2, 0):  # groups finish out of order
        finish(p, drawn[k][0], drawn[k][2], version=0)
    batch0 = p._take_batch(0)
    assert [g[0].prompt_index for g in batch0.groups] == [drawn[2][2].index, drawn[0][2].index]
    for k in (5, 1):
        finish(p, drawn[k][0], drawn[k][2], version=0)
    batch1 = p._take_batch(1)  # handed over for step 1, not trained when the save after step 0 runs
    assert batch1 is not None
    finish(p, drawn[4][0], drawn[4][2], version=1)  # buffered; drawn[3] is still in flight

    t.latest_version = 1  # step 0 trained
    t.save(1, batch0.stream_after, threading.Thread(target=lambda: None))
    state = json.loads((tmp_path / "checkpoints" / "step1" / "trainer_state.json").read_text())
    # in the order drawn: step 1's batch (1, 5), the one in flight (3), the buffered one (4)
    want = [order[1], order[3], order[4], order[5]]
    assert [pos for _, pos in state["open_prompts"]] == want
    assert all(epoch == 0 for epoch, _ in state["open_prompts"])
    assert (state["stream_epoch"], state["stream_offset"]) == (0, 6)  # past every prompt drawn, open ones included

    t2 = trainer(tmp_path, "--train.resume", "true", mode=mode)
    assert t2.resume() == 1
    p2 = producer(t2)
    again = [p2._draw() for _ in range(5)]
    assert positions(again)[:4] == want  # the open prompts first, with their epochs (their seeds)
    assert [epoch for _, epoch, _ in again[:4]] == [0] * 4
    # then the stream goes on where it was: the last prompt of epoch 0, then epoch 1
    assert positions(again)[4] == ({*range(7)} - set(order)).pop() and again[4][1] == 0
    # over the two runs: step 0's prompts trained once, the rest open again, none lost
    assert sorted([order[2], order[0], *positions(again)]) == list(range(7))


def test_a_dropped_group_is_done_with_and_a_trained_batch_closes_its_prompts(tmp_path):
    t = trainer(tmp_path, "--algo.dynamic_sampling", "true")
    p = producer(t)
    drawn = [p._draw() for _ in range(5)]
    finish(p, drawn[0][0], drawn[0][2], version=0)
    finish(p, drawn[1][0], drawn[1][2], version=0)
    assert p._take_batch(0) is not None
    finish(p, drawn[2][0], drawn[2][2], version=0)  # too old for step 2 (max_staleness 1): dropped at the take
    p._close(drawn[3][0])  # what _group does with an all-equal group under --algo.dynamic_sampling
    t.latest_version = 2
    assert p._take_batch(2) is None and p.dropped_stale == 1
    _, open_prompts = p.open_prompts(2)  # steps 0 and 1 trained: only drawn[4] is left open
    assert open_prompts == [(0, positions(drawn)[4])]
    assert p.batch_keys == {}


def test_a_batch_mode_resume_of_a_streaming_checkpoint_says_it_does_not_roll_the_open_prompts_again(tmp_path, capsys):
    t = trainer(tmp_path)
    p = t.streamer = producer(t)
    drawn = [p._draw() for _ in range(3)]
    t.save(0, (0, 0), threading.Thread(target=lambda: None))
    state = json.loads((tmp_path / "checkpoints" / "step0" / "trainer_state.json").read_text())
    assert len(state["open_prompts"]) == len(drawn)
    t2 = trainer(tmp_path, "--train.resume", "true", "--rollout.mode", "batch")
    t2.resume()
    assert t2.reopen == []
    assert "3 prompts in flight or buffered at the save" in capsys.readouterr().out
