"""--loss.agg: the four aggregations, exact against their formulas (fp64), and the same however a mini-batch is split
across micro-batches and data-parallel ranks when the mini-batch's counts are given (`normalizer`, `dp_size`)."""

import pytest
import torch

from entropy_openrlhf.algorithms.loss_terms import AGG_MODES, aggregate, entropy_bonus
from entropy_openrlhf.algorithms.objectives.base import LossContext


def batch(seed: int, rows: int = 6, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, width, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0] = 0  # an empty response: counted by no mode
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return loss, mask


def by_formula(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: float) -> float:
    """Each mode written out over Python lists, one sequence at a time."""
    seqs = [[float(v) for v, m in zip(row, keep) if m] for row, keep in zip(loss.tolist(), mask.tolist())]
    seqs = [s for s in seqs if s]  # empty responses count in no denominator
    if mode == "token_mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    per_seq = {
        "seq_mean_token_mean": [sum(s) / len(s) for s in seqs],
        "seq_mean_token_sum": [sum(s) for s in seqs],
        "seq_mean_token_sum_norm": [sum(s) / norm_len for s in seqs],
    }[mode]
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_mode_is_its_formula(mode, seed):
    loss, mask = batch(seed)
    got = aggregate(loss, mask, mode, norm_len=16.0)
    assert got.item() == pytest.approx(by_formula(loss, mask, mode, 16.0), rel=1e-12)
    if mode == "seq_mean_token_sum_norm":  # without a length: the matrix's width, as verl's default
        assert aggregate(loss, mask, mode).item() == pytest.approx(by_formula(loss, mask, mode, 9.0), rel=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_a_split_mini_batch_sums_to_the_whole_with_the_mini_batch_counts(mode):
    # 2 ranks x 3 micro-batches of 2 sequences: each part normalised by the whole mini-batch's count, summed over
    # the micro-batches, averaged over ranks (the data-parallel gradient average), gives the whole's loss
    loss, mask = batch(7, rows=12)
    norm_len = 16.0
    ctx = LossContext(
        agg=mode, agg_norm_len=norm_len, tokens=float(mask.sum()),
        sequences=float((mask.sum(-1) > 0).sum()), dp_size=2,
    )  # fmt: skip
    whole = by_formula(loss, mask, mode, norm_len)
    ranks = []
    for rank in range(2):
        rows = slice(rank * 6, rank * 6 + 6)
        parts = [
            aggregate(loss[rows][i : i + 2], mask[rows][i : i + 2], mode, ctx.normalizer, ctx.dp_size, norm_len)
            for i in range(0, 6, 2)
        ]
        ranks.append(sum(p.item() for p in parts))
    assert sum(ranks) / 2 == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_the_entropy_bonus_is_aggregated_as_the_loss_is(mode):
    entropy, mask = batch(3)
    entropy = entropy.abs()
    bonus = entropy_bonus(entropy, mask, 0.01, mode, normalizer=None)
    if mode == "seq_mean_token_sum_norm":  # the bonus has no length of its own: the width, as aggregate's default
        want = -0.01 * by_formula(entropy, mask, mode, float(mask.shape[-1]))
    else:
        want = -0.01 * by_formula(entropy, mask, mode, 1.0)
    assert bonus.item() == pytest.approx(want, rel=1e-12)


def test_the_norm_mode_over_a_mini_batch_needs_its_length():
    with pytest.raises(ValueError, match="agg_norm_len"):
        _ = LossContext(agg="seq_mean_token_sum_norm", sequences=4.0).normalizer
    assert LossContext(agg="seq_mean_token_sum_norm", sequences=4.0, agg_norm_len=128).normalizer == 512.0
    assert LossContext(agg="seq_mean_token_sum", sequences=4.0, tokens=40.0).normalizer == 4.0


def test_an_unknown_mode_is_named():
    loss, mask = batch(0)
    with pytest.raises(ValueError, match="unknown aggregation mode 'seq_sum'"):
        aggregate(loss, mask, "seq_sum")
