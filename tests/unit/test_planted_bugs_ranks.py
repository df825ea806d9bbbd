"""The step's results over data-parallel ranks (actors/step_data.py, PolicyGroup.train_step's merge): each rank's
share of the loss and its tokens, summed over ranks, must give what one rank reports for the whole batch.

Pure checks of the reduction first (the shares made by `aggregate` itself, as the micro-batches make them), then
the harness of tests/unit/policy_harness.py: two ranks as two processes over gloo on 127.0.0.1, each running
PolicyActor.train_step on its shard, against one rank on the whole batch and against the loss written out here.
"""

from __future__ import annotations

import pytest
import torch

from entropy_openrlhf.actors.step_data import merge_ranks, reduce_micro_batches
from entropy_openrlhf.algorithms.loss_terms import aggregate
from entropy_openrlhf.algorithms.objectives.base import LossContext
from tests.unit.policy_harness import (
    load_model,
    make_actor,
    make_samples,
    one_thread,
    run_ranks,
    shard,
    step_config,
    weights,
)
from tests.unit.test_planted_bugs_step import minus_mean_advantage

# ------------------------------------------------------------------------------------------ the reduction alone


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rank_shares_of_the_loss_sum_to_the_mini_batch_loss(world_size):
    """Catches the step's loss merged over ranks the wrong way (a mean where each rank holds a share, or a share
    left multiplied by the data-parallel size): two mini-batches, each split over the ranks into micro-batches whose
    losses `aggregate` computes with the mini-batch's token count and the data-parallel size, as
    train_micro_batch does; reduced per rank and merged, they give the mean of the two mini-batches' token means."""
    g = torch.Generator().manual_seed(world_size)
    per_rank = [{"loss/policy": [], "train/tokens": 0.0, "entropy/seq_mean": []} for _ in range(world_size)]
    want = []
    for _mini in range(2):
        loss = torch.randn(6 * world_size, 5, generator=g, dtype=torch.float64)
        mask = (torch.rand(loss.shape, generator=g) > 0.3).double()
        want.append(float((loss * mask).sum() / mask.sum()))  # the mini-batch's token mean
        ctx = LossContext(tokens=float(mask.sum()), dp_size=world_size)
        for r in range(world_size):
            rows = slice(6 * r, 6 * r + 6)
            for micro in (slice(0, 4), slice(4, 6)):  # two micro-batches of unequal size on each rank
                part_loss, part_mask = loss[rows][micro], mask[rows][micro]
                value = aggregate(part_loss, part_mask, "token_mean", ctx.normalizer, ctx.dp_size)
                per_rank[r]["loss/policy"].append(float(value))
                per_rank[r]["entropy/seq_mean"].append(1.0 + r)
            per_rank[r]["train/tokens"] += float(mask[rows].sum())
    results = []
    for m in per_rank:
        result = reduce_micro_batches({k: m[k] for k in ("loss/policy", "entropy/seq_mean")}, 2, world_size)
        result["train/tokens"] = m["train/tokens"]  # step_result counts the rank's tokens so
        results.append(result)
    merged = merge_ranks(results)
    assert merged["loss/policy"] == pytest.approx(sum(want) / 2, rel=1e-12)
    assert merged["train/tokens"] == sum(m["train/tokens"] for m in per_rank)
    assert merged["entropy/seq_mean"] == pytest.approx(sum(1.0 + r for r in range(world_size)) / world_size)


def test_tokens_are_summed_over_ranks_and_a_rank_missing_a_key_is_not_a_zero():
    """Catches train/tokens merged by a mean: the step trained on every rank's tokens."""
    merged = merge_ranks([
        {"loss/policy": 0.25, "loss/entropy_bonus": 0.0, "train/tokens": 30.0, "offpolicy/staleness_1/ess": 0.5},
        {"loss/policy": -0.75, "loss/entropy_bonus": 0.0, "train/tokens": 12.0},
    ])  # fmt: skip
    assert merged["train/tokens"] == 42.0
    assert merged["loss/policy"] == pytest.approx(-0.5)
    assert merged["offpolicy/staleness_1/ess"] == 0.5


# ------------------------------------------------------------------------------------------ two ranks over gloo

SCENARIOS = {
    # the weights held still (lr 0): the loss of every mini-batch is the one written out from the samples
    "still": dict(flags=(), lr=0.0, masked=False),
    # per-sequence means with a response whose every token is masked, on rank 0's share of the first mini-batch
    "seq_masked": dict(flags=("--loss.agg", "seq_mean_token_mean"), lr=0.0, masked=True),
    # the weights moving over two passes, with the token-level correction: the two ranks must train what one does
    "moving": dict(flags=("--train.ppo_epochs", "2", "--offpolicy.preset", "token_tis"), lr=1e-2, masked=False),
}


def scenario_samples(model, masked: bool):
    samples = make_samples(model, seed=11)
    if masked:
        samples[1].response_mask = [0] * len(samples[1].response_ids)
    return samples


def run_scenarios(rank: int, world_size: int, model_path: str) -> dict:
    """Every scenario's step on this rank: its metrics, and its weights afterwards on rank 0."""
    out = {}
    for name, sc in SCENARIOS.items():
        cfg = step_config(*sc["flags"])
        model = load_model(model_path)
        samples, sizes = shard(cfg, scenario_samples(model, sc["masked"]), world_size)[rank]
        metrics = make_actor(cfg, model, rank, world_size, lr=sc["lr"]).train_step(samples, 0, micro_sizes=sizes)
        out[name] = {"metrics": metrics, "weights": weights(model) if rank == 0 else None}
    return out


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def one_and_two(tiny) -> tuple[dict, dict]:
    """The scenarios on one rank (in this process) and on two (merged as PolicyGroup merges them)."""
    one = run_scenarios(0, 1, tiny)
    ranks = run_ranks(2, run_scenarios, tiny)
    two = {name: {"metrics": merge_ranks([r[name]["metrics"] for r in ranks]), "weights": ranks[0][name]["weights"]}
           for name in SCENARIOS}  # fmt: skip
    return one, two


@pytest.mark.parametrize("name", ["still", "seq_masked"])
def test_two_ranks_report_the_loss_and_tokens_one_rank_reports(tiny, one_and_two, name):
    """Catches the merged loss/policy multiplied by the data-parallel size or averaged where it must be summed, and
    train/tokens averaged over ranks: both merges of two ranks' step results must give the whole batch's loss
    written out from the samples (and one rank's), and every valid token of the batch."""
    model = load_model(tiny)
    samples = scenario_samples(model, SCENARIOS[name]["masked"])
    agg = "seq_mean_token_mean" if name == "seq_masked" else "token_mean"
    want = sum(minus_mean_advantage(samples[4 * m : 4 * m + 4], agg) for m in range(2)) / 2
    tokens = sum(sum(s.response_mask) if s.response_mask else len(s.response_ids) for s in samples)
    for result in one_and_two:
        assert result[name]["metrics"]["loss/policy"] == pytest.approx(want, rel=1e-6)
        assert result[name]["metrics"]["train/tokens"] == tokens


def test_two_ranks_train_the_weights_one_rank_trains(one_and_two):
    """Catches any part of the step that depends on the sharding (normalisers, gradient averaging, the optimizer
    steps of each pass): two passes of two mini-batches with the weights moving end where one rank ends."""
    one, two = (r["moving"] for r in one_and_two)
    assert two["metrics"]["loss/policy"] == pytest.approx(one["metrics"]["loss/policy"], rel=1e-4, abs=1e-6)
    assert two["metrics"]["train/skipped_steps"] == one["metrics"]["train/skipped_steps"] == 0.0
    diff = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
    assert diff < 1e-5
    start = one_and_two[0]["still"]["weights"]  # lr 0: the model as loaded
    assert max(float((one["weights"][k] - start[k]).abs().max()) for k in start) > 1e-3  # and they did train
