"""Metrics split by data source, logged only when a step mixes two or more sources: the driver's reward and length
per source (pipeline/batches.py::source_metrics) and each policy rank's entropy per source (train_phases.observe_old),
both against values computed here by hand."""

from types import SimpleNamespace

import pytest
import torch

from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.actors.train_phases import RankSetup, observe_old, prepare_step
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.batches import source_metrics
from entropy_openrlhf.samples import Sample

ENGINE = SimpleNamespace(device=torch.device("cpu"), module=SimpleNamespace(config=SimpleNamespace()))


def scored(source: str, reward: float, acc: bool, length: int) -> Sample:
    return Sample(0, "p", [1], "r", [5] * length, [-0.1] * length, "1", 0, data_source=source, reward=reward, acc=acc)


def test_the_driver_splits_accuracy_reward_and_length_by_source():
    samples = [
        scored("aime", 1.0, True, 10),
        scored("aime", 0.0, False, 30),
        scored("aime", 0.5, True, 20),
        scored("", 0.0, False, 4),  # no source: "default"
    ]
    got = source_metrics(samples)
    assert got == pytest.approx(
        {
            "reward/aime/acc": 2 / 3,
            "reward/aime/mean": 0.5,
            "rollout/aime/response_len": 20.0,
            "reward/default/acc": 0.0,
            "reward/default/mean": 0.0,
            "rollout/default/response_len": 4.0,
        }
    )


def test_one_source_adds_nothing():
    assert source_metrics([scored("math", 1.0, True, 3), scored("math", 0.0, False, 5)]) == {}
    assert source_metrics([scored("", 1.0, True, 3)]) == {}


def test_each_rank_logs_the_entropy_of_each_source_it_holds():
    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "1",
                     "--actor.micro_batch_size", "4", "--train.shared_prefix", "off"])  # fmt: skip
    lengths, sources = [3, 1, 2, 2], ["aime", "math", "aime", "math"]
    samples = [TrainSample([1, 2], [7] * n, 1.0, [-0.5] * n, data_source=src) for n, src in zip(lengths, sources)]
    s = prepare_step(RankSetup(cfg, 0, 1, pad_id=0), ENGINE, samples, step=0, strength_scale=1.0, entropy_coef=None)
    (b,) = s.batches
    entropy = torch.rand(b.mask.shape)
    s.entropies[0], s.old_lp[0] = entropy, s.rollout_lp[0].clone()
    observe_old(cfg, s, 0)
    # each response's tokens sit on the shifted grid at positions 1 .. n (a prompt of two)
    per_response = [float(entropy[r, 1 : 1 + n].mean()) for r, n in enumerate(lengths)]
    assert s.metrics["entropy/aime/seq_mean"] == pytest.approx([(per_response[0] + per_response[2]) / 2])
    assert s.metrics["entropy/math/seq_mean"] == pytest.approx([(per_response[1] + per_response[3]) / 2])
    assert s.metrics["entropy/seq_mean"] == pytest.approx([sum(per_response) / 4])


def test_a_source_whose_tokens_are_all_masked_logs_no_entropy_in_that_micro_batch():
    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "3", "--train.mini_batches", "1",
                     "--actor.micro_batch_size", "3", "--train.shared_prefix", "off"])  # fmt: skip
    samples = [TrainSample([1, 2], [7, 7], 1.0, [-0.5, -0.5], data_source=src) for src in ("aime", "math", "math")]
    s = prepare_step(RankSetup(cfg, 0, 1, pad_id=0), ENGINE, samples, step=0, strength_scale=1.0, entropy_coef=None)
    (b,) = s.batches
    b.mask[0] = 0  # the aime response cut at the length limit under --loss.mask_truncated
    entropy = torch.rand(b.mask.shape)
    s.entropies[0], s.old_lp[0] = entropy, s.rollout_lp[0].clone()
    observe_old(cfg, s, 0)
    assert "entropy/aime/seq_mean" not in s.metrics  # a 0 here would pull the step's aime entropy down
    assert s.metrics["entropy/math/seq_mean"] == pytest.approx([float(entropy[1:, 1:3].mean())])


def test_without_sources_a_rank_logs_no_entropy_by_source():
    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "2", "--train.mini_batches", "1",
                     "--train.shared_prefix", "off"])  # fmt: skip
    samples = [TrainSample([1, 2], [7, 7], 1.0, [-0.5, -0.5]) for _ in range(2)]
    s = prepare_step(RankSetup(cfg, 0, 1, 0), ENGINE, samples, 0, 1.0, None)
    s.entropies[0], s.old_lp[0] = torch.rand(s.batches[0].mask.shape), s.rollout_lp[0].clone()
    observe_old(cfg, s, 0)
    assert not [k for k in s.metrics if k.startswith("entropy/") and k.count("/") == 2]
    assert "entropy/seq_mean" in s.metrics


def test_the_trainer_hands_each_sample_its_source_only_when_the_step_mixes_sources():
    from tests.unit.test_rollouts import trainer_with  # its stand-in engines, reward and sync

    trainer = trainer_with("tests.unit.test_rollouts:tool_turn")
    batch = trainer._make_batch(0)
    flat = [s for g in batch.groups for s in g]
    assert [t.data_source for t in trainer._train_samples(batch)] == [""] * len(flat)  # one source: nothing split
    for s, source in zip(flat, ["aime", "aime", "", ""]):
        s.data_source = source
    assert [t.data_source for t in trainer._train_samples(batch)] == ["aime", "aime", "default", "default"]
