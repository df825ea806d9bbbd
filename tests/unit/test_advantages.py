"""Advantage estimators against values worked out by hand (the arithmetic is written next to each number)."""

import math

import pytest
import torch

from entropy_openrlhf.algorithms.advantages import (
    ESTIMATORS,
    GRPO_EPS,
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)


def approx(values, rel=1e-5, abs=1e-7):
    return pytest.approx(values, rel=rel, abs=abs)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def ids(*xs):
    return torch.tensor(xs, dtype=torch.long)


# ---------------------------------------------------------------- GRPO


def test_grpo_one_group_unbiased_std_plus_eps():
    # rewards 1, 0, 1, 0: mean 0.5, deviations +-0.5;
    # unbiased variance = 4 * 0.25 / (4 - 1) = 1/3, std = sqrt(1/3) = 0.5773503 (the biased std would be 0.5)
    std = math.sqrt(1 / 3)
    a = 0.5 / (std + 1e-6)  # = 0.8660239, not 1.0 as the biased std would give
    out = grpo_advantages(t(1, 0, 1, 0), ids(7, 7, 7, 7))
    assert out.dtype == torch.float32
    assert out.tolist() == approx([a, -a, a, -a])
    assert out[0].item() == pytest.approx(0.8660239, rel=1e-5)


def test_grpo_eps_matters_for_a_tiny_std():
    # rewards 0, 1e-6: mean 5e-7, deviations -+5e-7; unbiased std = sqrt(2 * (5e-7)^2 / 1) = 7.0710678e-7
    # A = 5e-7 / (7.0710678e-7 + 1e-6) = 0.2928932 (without the eps it would be 1/sqrt(2) = 0.7071)
    assert GRPO_EPS == 1e-6
    out = grpo_advantages(t(0.0, 1e-6), ids(0, 0))
    assert out.tolist() == approx([-0.2928932, 0.2928932], rel=1e-4)


def test_grpo_non_contiguous_groups():
    # group 0 at positions 0, 2, 4: rewards 1, 0, 2 -> mean 1, deviations 0, -1, +1;
    #   unbiased var = (0 + 1 + 1) / 2 = 1, std 1 -> A = 0, -1/(1+1e-6), 1/(1+1e-6)
    # group 1 at positions 1, 3, 5: rewards 2, 5, 8 -> mean 5, deviations -3, 0, +3;
    #   unbiased var = (9 + 0 + 9) / 2 = 9, std 3 -> A = -3/(3+1e-6), 0, 3/(3+1e-6)
    out = grpo_advantages(t(1, 2, 0, 5, 2, 8), ids(0, 1, 0, 1, 0, 1))
    g0 = 1 / (1 + 1e-6)
    g1 = 3 / (3 + 1e-6)
    assert out.tolist() == approx([0.0, -g1, -g0, 0.0, g0, g1])


def test_grpo_group_ids_need_not_be_small_or_sorted():
    # the same two groups under ids 42 and -3 given in a different order
    a = grpo_advantages(t(1, 2, 0, 5, 2, 8), ids(42, -3, 42, -3, 42, -3))
    b = grpo_advantages(t(1, 2, 0, 5, 2, 8), ids(0, 1, 0, 1, 0, 1))
    assert torch.equal(a, b)


def test_grpo_size_one_group_and_all_equal_group_give_zero():
    # group 5 holds one response (reward 1): no baseline -> 0
    # group 6 is all-equal (3, 3, 3): deviations 0 -> 0 / (0 + 1e-6) = 0
    # group 9 (0, 1): mean 0.5, unbiased std = sqrt(2 * 0.25 / 1) = 0.7071068 -> A = -+0.5/0.7071078 = -+0.7071058
    out = grpo_advantages(t(1, 3, 3, 3, 0, 1), ids(5, 6, 6, 6, 9, 9))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert out.tolist() == approx([0.0, 0.0, 0.0, 0.0, -a, a])
    assert torch.isfinite(out).all()


def test_grpo_integer_and_bool_rewards_are_accepted():
    # bool correctness 1, 0, 0: mean 1/3, deviations 2/3, -1/3, -1/3; unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3
    std = math.sqrt(1 / 3)
    out = grpo_advantages(torch.tensor([True, False, False]), ids(0, 0, 0))
    assert out.dtype == torch.float32
    assert out.tolist() == approx([(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)])


# ---------------------------------------------------------------- Dr.GRPO


def test_dr_grpo_removes_the_mean_only():
    # group 0 (positions 0, 2, 4): 1, 0, 2 -> mean 1 -> 0, -1, +1
    # group 1 (positions 1, 3, 5): 2, 5, 8 -> mean 5 -> -3, 0, +3  (GRPO would give -1, 0, 1 here)
    out = compute_advantages(t(1, 2, 0, 5, 2, 8), ids(0, 1, 0, 1, 0, 1), "dr_grpo")
    assert out.tolist() == approx([0.0, -3.0, -1.0, 0.0, 1.0, 3.0])
    assert torch.equal(out, grpo_advantages(t(1, 2, 0, 5, 2, 8), ids(0, 1, 0, 1, 0, 1), scale_by_std=False))
    # a lone response still gets 0, an all-equal group 0
    assert compute_advantages(t(4, 2, 2), ids(0, 1, 1), "dr_grpo").tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out_baseline():
    # group 0: 1, 0, 1, 1 (k=4, sum 3): A_i = r_i - (3 - r_i) / 3
    #   -> 1 - 2/3 = 1/3, 0 - 3/3 = -1, 1/3, 1/3
    # group 1 (positions 4, 6): 2, 5 -> 2 - 5 = -3, 5 - 2 = 3
    # group 2 (position 5): a lone response -> 0
    out = rloo_advantages(t(1, 0, 1, 1, 2, 9, 5), ids(0, 0, 0, 0, 1, 2, 1))
    assert out.tolist() == approx([1 / 3, -1.0, 1 / 3, 1 / 3, -3.0, 0.0, 3.0])
    assert torch.equal(compute_advantages(t(1, 0, 1, 1, 2, 9, 5), ids(0, 0, 0, 0, 1, 2, 1), "rloo"), out)


def test_rloo_is_the_centred_reward_scaled_by_k_over_k_minus_1():
    # r_i - (S - r_i)/(k-1) = (k r_i - S)/(k-1) = k/(k-1) (r_i - mean): for 1, 0, 1, 1 -> 4/3 * (0.25, -0.75, ...)
    out = rloo_advantages(t(1, 0, 1, 1), ids(0, 0, 0, 0))
    assert out.tolist() == approx([4 / 3 * 0.25, -4 / 3 * 0.75, 4 / 3 * 0.25, 4 / 3 * 0.25])


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_whitens_over_the_batch_ignoring_groups():
    # rewards 1, 2, 3, 4: mean 2.5; unbiased var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3, std 1.2909944
    # A = (-1.5, -0.5, 0.5, 1.5) / (1.2909944 + 1e-6)
    std = math.sqrt(5 / 3) + 1e-6
    expected = [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std]
    assert reinforce_pp_advantages(t(1, 2, 3, 4)).tolist() == approx(expected)
    # group ids play no part: per group (0, 0, 1, 1) GRPO would give -+0.7071 in each group
    out = compute_advantages(t(1, 2, 3, 4), ids(0, 0, 1, 1), "reinforce_pp")
    assert out.tolist() == approx(expected)
    assert out[0].item() == pytest.approx(-1.161895, rel=1e-5)


def test_reinforce_pp_degenerate_batches():
    assert reinforce_pp_advantages(t(3.0)).tolist() == [0.0]
    assert reinforce_pp_advantages(t(2, 2, 2)).tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- dispatch and broadcast


def test_compute_advantages_dispatch():
    r, g = t(1, 2, 0, 5, 2, 8), ids(0, 1, 0, 1, 0, 1)
    assert set(ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    assert torch.equal(compute_advantages(r, g), grpo_advantages(r, g))  # grpo is the default
    assert torch.equal(compute_advantages(r, g, "grpo"), grpo_advantages(r, g))
    assert torch.equal(compute_advantages(r, g, "dr_grpo"), grpo_advantages(r, g, scale_by_std=False))
    assert torch.equal(compute_advantages(r, g, "rloo"), rloo_advantages(r, g))
    assert torch.equal(compute_advantages(r, g, "reinforce_pp"), reinforce_pp_advantages(r))
    # the four really differ on this batch
    outs = [tuple(compute_advantages(r, g, e).tolist()) for e in ESTIMATORS]
    assert len(set(outs)) == 4


def test_compute_advantages_unknown_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'.*grpo, dr_grpo, rloo, reinforce_pp"):
        compute_advantages(t(1, 0), ids(0, 0), "gae")


def test_broadcast_to_tokens():
    adv = t(0.5, -1.0, 2.0)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    out = broadcast_to_tokens(adv, mask)
    assert out.dtype == torch.float32 and out.shape == (3, 3)
    assert out.tolist() == [[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # float masks and float64 advantages give the same fp32 grid
    out64 = broadcast_to_tokens(adv.double(), mask.float())
    assert out64.dtype == torch.float32 and torch.equal(out64, out)
