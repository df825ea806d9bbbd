"""Loss tests against an independent scalar implementation (plain Python floats, written from
docs/algorithms/losses.md)."""

import math

import pytest
import torch

from entropy_openrlhf.algorithms.losses import (
    aggregate,
    clip_cov_loss,
    clip_cov_select,
    kl_cov_loss,
    kl_cov_select,
    ppo_loss,
)

# ---------------------------------------------------------------- independent reference (scalar Python)


def _valid_tokens(mask):
    return [(b, t) for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]


def ref_cov(lp, adv, mask):
    toks = _valid_tokens(mask)
    a_mean = sum(adv[b][t] for b, t in toks) / len(toks)
    l_mean = sum(lp[b][t] for b, t in toks) / len(toks)
    return {(b, t): (adv[b][t] - a_mean) * (lp[b][t] - l_mean) for b, t in toks}


def ref_ppo_token(lp, old, a, lo, hi, dual=None):
    d = max(-20.0, min(20.0, lp - old))
    r = math.exp(d)
    u1, u2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    out = max(u1, u2)
    if dual is not None and a < 0:
        out = min(out, -a * dual)
    return out, u2 > u1


def ref_ppo(lp, old, adv, mask, lo, hi, dual=None):
    toks = _valid_tokens(mask)
    return sum(ref_ppo_token(lp[b][t], old[b][t], adv[b][t], lo, hi, dual)[0] for b, t in toks) / len(toks)


def ref_clip_cov_candidates(lp, old, adv, mask, lb, ub, lo, hi):
    cov = ref_cov(lp, adv, mask)
    return {
        k
        for k, c in cov.items()
        if lb < c < ub and not ref_ppo_token(lp[k[0]][k[1]], old[k[0]][k[1]], adv[k[0]][k[1]], lo, hi)[1]
    }


def ref_kl_cov(lp, old, adv, mask, ratio, coef):
    toks = _valid_tokens(mask)
    cov = ref_cov(lp, adv, mask)
    k = max(1, math.floor(ratio * len(toks)))
    top = set(sorted(cov, key=lambda x: cov[x], reverse=True)[:k])
    total = 0.0
    for b, t in toks:
        d = max(-20.0, min(20.0, lp[b][t] - old[b][t]))
        total += -adv[b][t] * math.exp(d) + (coef * abs(d) if (b, t) in top else 0.0)
    return total / len(toks), top


def batch(seed=0, B=6, L=9, spread=0.3):
    """Random log-probs, a perturbed old policy, GRPO-like per-sequence advantages, ragged masks."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g) * 4.0
    old = lp + torch.randn(B, L, generator=g) * spread
    adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, L).contiguous()
    lengths = torch.randint(2, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    return lp, old, adv, mask


def as_lists(*ts):
    return [t.tolist() for t in ts]


# ---------------------------------------------------------------- PPO


def test_ppo_hand_computed():
    lp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.1), 0.0]])
    old = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.2), 0.0]])
    adv = torch.tensor([[1.0, 1.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # ratios 2.0, 1.0, 0.5; clip 0.2: token0 A>0 -> -1*min(2, 1.2) = -1.2; token1 -> -1; token2 A<0 ->
    # max(2*0.5, 2*0.8) = 1.6. Mean over 3 valid tokens.
    out = ppo_loss(lp, old, adv, mask)
    assert out.loss.item() == pytest.approx((-1.2 - 1.0 + 1.6) / 3, rel=1e-6)
    assert out.token_loss[0, 3].item() == 0.0
    assert out.metrics["ppo_clip_frac_high"] == pytest.approx(1 / 3)
    assert out.metrics["ppo_clip_frac_low"] == pytest.approx(1 / 3)
    assert not out.selected.any()


@pytest.mark.parametrize("lo,hi,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.2, 3.0), (1.0, 1.0, None)])
def test_ppo_matches_reference(lo, hi, dual):
    lp, old, adv, mask = batch(seed=1, spread=0.6)
    out = ppo_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi, dual_clip=dual)
    expected = ref_ppo(*as_lists(lp, old, adv, mask), lo, hi, dual)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    toks = _valid_tokens(mask.tolist())
    assert out.metrics["ppo_kl"] == pytest.approx(sum((old - lp)[b, t].item() for b, t in toks) / len(toks), rel=1e-5)


def test_dual_clip_changes_large_negative_advantage_tokens():
    lp = torch.tensor([[2.0]])
    old = torch.tensor([[0.0]])
    adv = torch.tensor([[-1.0]])
    mask = torch.ones(1, 1)
    assert ppo_loss(lp, old, adv, mask).loss.item() == pytest.approx(math.exp(2.0), rel=1e-6)
    assert ppo_loss(lp, old, adv, mask, dual_clip=3.0).loss.item() == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(lp, old, adv, mask, dual_clip=0.5)


# ---------------------------------------------------------------- Clip-Cov


def clip_cov_batch():
    # Wide spread in log-probs and advantages so several token covariances fall inside (1, 5).
    lp, old, adv, mask = batch(seed=3, B=8, L=12, spread=0.2)
    return lp * 2.0, old * 2.0, adv * 2.0, mask


def test_clip_cov_candidates_and_quota_match_reference():
    lp, old, adv, mask = clip_cov_batch()
    cands = ref_clip_cov_candidates(*as_lists(lp, old, adv, mask), 1.0, 5.0, 1.0, 1.0)
    assert len(cands) >= 3, "test batch should have several candidates"
    n = int(mask.sum())
    for ratio, want in [(1e-4, 1), (0.05, max(1, math.floor(0.05 * n))), (1.0, len(cands))]:
        sel = clip_cov_select(lp, old, adv, mask, ratio=ratio, generator=torch.Generator().manual_seed(0))
        chosen = {tuple(x) for x in sel.nonzero().tolist()}
        assert chosen <= cands
        assert len(chosen) == min(want, len(cands))


def test_clip_cov_random_choice_is_seeded_and_uniform_over_candidates():
    lp, old, adv, mask = clip_cov_batch()
    a = clip_cov_select(lp, old, adv, mask, ratio=0.02, generator=torch.Generator().manual_seed(7))
    b = clip_cov_select(lp, old, adv, mask, ratio=0.02, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    cands = ref_clip_cov_candidates(*as_lists(lp, old, adv, mask), 1.0, 5.0, 1.0, 1.0)
    seen = set()
    for seed in range(500):
        sel = clip_cov_select(lp, old, adv, mask, ratio=1e-4, generator=torch.Generator().manual_seed(seed))
        seen |= {tuple(x) for x in sel.nonzero().tolist()}
    assert seen == cands  # every candidate gets drawn sometimes: random, not top-k


def test_clip_cov_loss_value_and_zero_gradient_on_selected():
    lp, old, adv, mask = clip_cov_batch()
    lp = lp.clone().requires_grad_(True)
    out = clip_cov_loss(lp, old, adv, mask, ratio=0.1, generator=torch.Generator().manual_seed(1))
    sel = {tuple(x) for x in out.selected.nonzero().tolist()}
    assert len(sel) >= 2
    L = as_lists(lp.detach(), old, adv, mask)
    toks = _valid_tokens(L[3])
    expected = sum(ref_ppo_token(L[0][b][t], L[1][b][t], L[2][b][t], 1.0, 1.0)[0] for b, t in toks if (b, t) not in sel)
    assert out.loss.item() == pytest.approx(expected / len(toks), rel=1e-5)  # selected stay in the denominator
    out.loss.backward()
    ppo_lp = lp.detach().clone().requires_grad_(True)
    ppo_loss(ppo_lp, old, adv, mask, clip_low=1.0, clip_high=1.0).loss.backward()
    for b, t in toks:
        if (b, t) in sel:
            assert lp.grad[b, t].item() == 0.0
        else:
            assert lp.grad[b, t].item() == pytest.approx(ppo_lp.grad[b, t].item(), rel=1e-5, abs=1e-9)
    assert out.metrics["clip_cov_frac"] == pytest.approx(len(sel) / len(toks))


def test_clip_cov_without_candidates_equals_ppo():
    lp, old, adv, mask = batch(seed=4)
    lp1 = lp.clone().requires_grad_(True)
    lp2 = lp.clone().requires_grad_(True)
    # Bounds no covariance can fall between.
    out = clip_cov_loss(lp1, old, adv, mask, cov_lb=1e6, cov_ub=2e6, clip_low=0.2, clip_high=0.28)
    ref = ppo_loss(lp2, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert not out.selected.any()
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    out.loss.backward()
    ref.loss.backward()
    assert torch.allclose(lp1.grad, lp2.grad)


def test_clip_cov_never_selects_ppo_clipped_tokens():
    lp, old, adv, mask = clip_cov_batch()
    old = lp - torch.randn(lp.shape, generator=torch.Generator().manual_seed(9)) * 2.0  # many ratios outside [0.8,1.2]
    sel = clip_cov_select(lp, old, adv, mask, ratio=1.0, cov_lb=-1e9, cov_ub=1e9, clip_low=0.2, clip_high=0.2)
    for b, t in sel.nonzero().tolist():
        assert not ref_ppo_token(lp[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.2)[1]
    assert sel.sum() > 0


# ---------------------------------------------------------------- KL-Cov


@pytest.mark.parametrize("ratio,coef", [(2e-3, 1.0), (0.1, 1.0), (0.25, 0.5)])
def test_kl_cov_matches_reference(ratio, coef):
    lp, old, adv, mask = batch(seed=5, B=8, L=10)
    out = kl_cov_loss(lp, old, adv, mask, ratio=ratio, coef=coef)
    expected, top = ref_kl_cov(*as_lists(lp, old, adv, mask), ratio, coef)
    assert {tuple(x) for x in out.selected.nonzero().tolist()} == top
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    toks = _valid_tokens(mask.tolist())
    assert out.metrics["kl_cov_frac"] == pytest.approx(len(top) / len(toks))
    assert out.metrics["ppo_kl"] == pytest.approx(
        sum(abs((lp - old)[b, t].item()) for b, t in toks) / len(toks), rel=1e-5
    )


def test_kl_cov_penalty_gradient_is_coef_sign_of_log_ratio():
    lp, old, adv, mask = batch(seed=6, B=8, L=10)
    coef = 0.7
    lp1 = lp.clone().requires_grad_(True)
    out = kl_cov_loss(lp1, old, adv, mask, ratio=0.2, coef=coef)
    out.loss.backward()
    n = mask.sum().item()
    for b, t in _valid_tokens(mask.tolist()):
        d = lp[b, t].item() - old[b, t].item()
        pg = -adv[b, t].item() * math.exp(d)
        penalty = coef * math.copysign(1.0, d) if out.selected[b, t] else 0.0
        assert lp1.grad[b, t].item() == pytest.approx((pg + penalty) / n, rel=1e-4, abs=1e-8)
    assert out.selected.sum() >= 2


def test_kl_cov_on_policy_is_unclipped_policy_gradient():
    lp, _, adv, mask = batch(seed=7)
    lp1 = lp.clone().requires_grad_(True)
    out = kl_cov_loss(lp1, lp.clone(), adv, mask, ratio=0.3)
    out.loss.backward()
    assert out.selected.sum() > 0
    n = mask.sum()
    assert out.loss.item() == pytest.approx((-(adv * mask).sum() / n).item(), rel=1e-6)
    assert torch.allclose(lp1.grad, -adv * mask / n, atol=1e-7)


def test_kl_cov_selects_top_covariance_not_random():
    lp, old, adv, mask = batch(seed=8, B=8, L=10)
    s1 = kl_cov_select(lp, adv, mask, ratio=0.05)
    s2 = kl_cov_select(lp, adv, mask, ratio=0.05)
    assert torch.equal(s1, s2)
    assert not (s1 & ~mask.bool()).any()


# ---------------------------------------------------------------- shared guards


@pytest.mark.parametrize("fn", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, 100.0])
def test_ratio_outside_unit_interval_is_a_clear_error(fn, bad):
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=r"ratio.*\(0, 1\]"):
        if fn == "clip_cov":
            clip_cov_loss(lp, old, adv, mask, ratio=bad)
        else:
            kl_cov_loss(lp, old, adv, mask, ratio=bad)


def test_ratio_one_selects_everything_for_kl_cov():
    lp, old, adv, mask = batch()
    assert torch.equal(kl_cov_select(lp, adv, mask, ratio=1.0), mask.bool())


@pytest.mark.parametrize("name", ["ppo", "clip_cov", "kl_cov"])
def test_empty_mask_gives_finite_zero_loss(name):
    lp, old, adv, _ = batch()
    lp = lp.clone().requires_grad_(True)
    mask = torch.zeros_like(lp)
    fn = {"ppo": ppo_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}[name]
    out = fn(lp, old, adv, mask)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.all(lp.grad == 0)
    assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", ["ppo", "clip_cov", "kl_cov"])
def test_garbage_on_padding_does_not_leak(name):
    lp, old, adv, mask = batch(seed=2)
    fn = {"ppo": ppo_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}[name]
    seeded = lambda: {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}  # noqa: E731
    clean = fn(lp, old, adv, mask, **seeded())
    dirty_lp = torch.where(mask.bool(), lp, torch.tensor(float("nan"))).requires_grad_(True)
    dirty_old = torch.where(mask.bool(), old, torch.tensor(float("inf")))
    out = fn(dirty_lp, dirty_old, adv, mask, **seeded())
    assert out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-6)
    out.loss.backward()
    assert torch.isfinite(dirty_lp.grad).all()


def test_log_ratio_is_clamped_before_exp():
    lp = torch.tensor([[80.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    out = kl_cov_loss(lp, old, adv, mask, ratio=0.5, coef=0.0)
    assert math.isfinite(out.loss.item())
    assert out.token_loss[0, 0].item() == pytest.approx(-math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize("name", ["ppo", "clip_cov", "kl_cov"])
def test_math_is_fp32_for_bf16_inputs(name):
    lp, old, adv, mask = batch(seed=3)
    lpb, oldb, advb = lp.bfloat16(), old.bfloat16(), adv.bfloat16()
    fn = {"ppo": ppo_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}[name]
    kw = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    out = fn(lpb, oldb, advb, mask, **kw)
    kw = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    ref = fn(lpb.float(), oldb.float(), advb.float(), mask, **kw)
    assert out.loss.dtype == torch.float32 and out.token_loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(token_loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(token_loss, mask, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(token_loss, mask, "token_mean", normalizer=8).item() == pytest.approx(10 / 8)
    assert aggregate(token_loss, mask, "token_mean", normalizer=8, dp_size=2).item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(token_loss, mask, "sum")


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_global_normalizer_makes_micro_batching_invisible(agg):
    lp, old, adv, mask = batch(seed=11, B=8, L=10)
    full_lp = lp.clone().requires_grad_(True)
    full = ppo_loss(full_lp, old, adv, mask, agg=agg)
    full.loss.backward()
    norm = mask.sum().item() if agg == "token_mean" else float((mask.sum(-1) > 0).sum())
    split_lp = lp.clone().requires_grad_(True)
    total = 0.0
    for idx in (slice(0, 3), slice(3, 8)):  # uneven micro-batches
        part = ppo_loss(split_lp[idx], old[idx], adv[idx], mask[idx], agg=agg, normalizer=norm)
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-6)
    assert torch.allclose(split_lp.grad, full_lp.grad, atol=1e-8)


def test_aggregation_agrees_with_openrlhf():
    from entropy_openrlhf.compat import ensure_flash_attn_importable

    ensure_flash_attn_importable()
    from openrlhf.models.loss import aggregate_loss

    g = torch.Generator().manual_seed(0)
    token_loss = torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    mask[2] = 0
    assert aggregate(token_loss, mask).item() == pytest.approx(aggregate_loss(token_loss, mask).item(), rel=1e-6)
    ours = aggregate(token_loss, mask, "token_mean", normalizer=40.0, dp_size=4)
    theirs = aggregate_loss(token_loss, mask, True, dp_size=4, batch_num_tokens=40.0)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    ours = aggregate(token_loss, mask, "seq_mean_token_mean", normalizer=9.0, dp_size=2)
    theirs = aggregate_loss(token_loss, mask, False, dp_size=2, global_batch_size=9.0)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_covariance_metrics_match_reference():
    lp, old, adv, mask = batch(seed=12, B=8, L=10)
    out = kl_cov_loss(lp, old, adv, mask, ratio=0.1)
    cov = ref_cov(*as_lists(lp, adv, mask))
    vals = sorted(cov.values())
    assert out.metrics["cov_mean"] == pytest.approx(sum(vals) / len(vals), abs=1e-6)
    assert out.metrics["cov_max"] == pytest.approx(vals[-1], rel=1e-5)
    sel = [cov[tuple(x)] for x in out.selected.nonzero().tolist()]
    assert out.metrics["cov_selected_mean"] == pytest.approx(sum(sel) / len(sel), rel=1e-5)
    assert vals[int(0.9 * len(vals))] <= out.metrics["cov_p99"] <= vals[-1]


# ---------------------------------------------------------------- whether a selection can act at this size


def test_selection_quota_and_starvation_metrics_by_hand():
    lp, old, adv, mask = batch(seed=7)
    n = int(mask.sum())
    lists = as_lists(lp, old, adv, mask)
    in_bounds = sum(0.1 < c < 5 for c in ref_cov(lists[0], lists[2], lists[3]).values())
    # a quota of floor(ratio * N) >= 2 with candidates: not starved
    ratio = 2.5 / n
    out = clip_cov_loss(lp, old, adv, mask, ratio=ratio, cov_lb=0.1, cov_ub=5.0)
    candidates = ref_clip_cov_candidates(*lists, 0.1, 5.0, 1.0, 1.0)
    assert len(candidates) >= 2  # the batch has room for the quota below
    assert out.metrics["select_tokens"] == n and out.metrics["select_quota"] == 2.0
    assert out.metrics["select_starved"] == 0.0 and out.selected.sum() == 2
    assert out.metrics["clip_cov_in_bounds"] == pytest.approx(in_bounds / n)
    # the paper's 2e-4 of N tokens is the one-token floor: starved although a token was detached
    out = clip_cov_loss(lp, old, adv, mask, ratio=2e-4, cov_lb=0.1, cov_ub=5.0)
    assert out.metrics["select_quota"] == 1.0 and out.selected.sum() == 1 and out.metrics["select_starved"] == 1.0
    # a real quota but no candidate between the bounds: starved too
    out = clip_cov_loss(lp, old, adv, mask, ratio=0.5, cov_lb=1e6, cov_ub=2e6)
    assert out.metrics["select_quota"] == math.floor(0.5 * n) and out.metrics["select_starved"] == 1.0
    # KL-Cov always fills its quota: starved exactly when the quota is the floor
    assert kl_cov_loss(lp, old, adv, mask, ratio=1 / n).metrics["select_starved"] == 0.0
    assert kl_cov_loss(lp, old, adv, mask, ratio=0.99 / n).metrics["select_starved"] == 1.0


def test_clip_cov_bounds_in_std_units_by_hand_and_scale_free():
    lp, old, adv, mask = batch(seed=11, B=8, L=12)
    lists = as_lists(lp, old, adv, mask)
    cov = ref_cov(lists[0], lists[2], lists[3])
    mean = sum(cov.values()) / len(cov)
    std = math.sqrt(sum((c - mean) ** 2 for c in cov.values()) / len(cov))  # population std over valid tokens
    lb, ub = 0.5, 3.0
    candidates = ref_clip_cov_candidates(*lists, lb * std, ub * std, 1.0, 1.0)
    assert 0 < len(candidates) < len(cov)  # the band holds some tokens, not all: the check below can fail
    n = len(cov)
    # a quota above the candidate count selects every candidate: the selected set is the band, exactly
    out = clip_cov_loss(lp, old, adv, mask, ratio=1.0, cov_lb=lb, cov_ub=ub, bounds_unit="std")
    chosen = {tuple(ix) for ix in out.selected.nonzero().tolist()}
    assert chosen == candidates
    assert out.metrics["clip_cov_lb"] == pytest.approx(lb * std, rel=1e-5)
    in_band = sum(lb * std < c < ub * std for c in cov.values())
    assert out.metrics["clip_cov_in_bounds"] == pytest.approx(in_band / n)
    # advantages 100x larger: covariances 100x larger. In std units the same tokens are chosen; the paper's
    # absolute bounds pick another set (here: the scaled covariances leave its band)
    abs_small = clip_cov_select(lp, old, adv, mask, ratio=1.0, cov_lb=lb, cov_ub=ub)
    scaled = clip_cov_select(lp, old, adv * 100, mask, ratio=1.0, cov_lb=lb, cov_ub=ub, bounds_unit="std")
    abs_scaled = clip_cov_select(lp, old, adv * 100, mask, ratio=1.0, cov_lb=lb, cov_ub=ub)
    assert torch.equal(scaled, out.selected) and not torch.equal(abs_scaled, abs_small)
    with pytest.raises(ValueError, match="clip_cov bounds unit 'sigma': one of abs, std"):
        clip_cov_select(lp, old, adv, mask, ratio=1.0, bounds_unit="sigma")


def test_kl_cov_ppo_clip_ablation_is_ppo_plus_the_penalty_by_hand():
    """--loss.kl_cov.ppo_clip: PPO's clipped surrogate on every token plus coef*|d| on the selected ones."""
    lp, old, adv, mask = batch(seed=5, spread=0.6)  # a wide spread: some ratios leave the clip range
    lists = as_lists(lp, old, adv, mask)
    lo, hi, coef, ratio = 0.2, 0.28, 0.7, 0.1
    out = kl_cov_loss(lp, old, adv, mask, ratio=ratio, coef=coef, ppo_clip=(lo, hi))
    _, top = ref_kl_cov(*lists, ratio, coef)
    want = 0.0
    clipped = 0
    for b, t in _valid_tokens(lists[3]):
        token, was_clipped = ref_ppo_token(lists[0][b][t], lists[1][b][t], lists[2][b][t], lo, hi)
        clipped += was_clipped
        d = max(-20.0, min(20.0, lists[0][b][t] - lists[1][b][t]))
        want += token + (coef * abs(d) if (b, t) in top else 0.0)
    n = len(_valid_tokens(lists[3]))
    assert clipped > 0  # the clip binds somewhere: the check could fail
    assert float(out.loss) == pytest.approx(want / n, rel=1e-5)
    assert out.metrics["ppo_clip_frac_low"] + out.metrics["ppo_clip_frac_high"] > 0
    # coef 0: exactly PPO's loss; without the ablation: the paper's unclipped base, which differs here
    assert float(kl_cov_loss(lp, old, adv, mask, ratio=ratio, coef=0.0, ppo_clip=(lo, hi)).loss) == pytest.approx(
        float(ppo_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi).loss), rel=1e-6
    )
    assert float(kl_cov_loss(lp, old, adv, mask, ratio=ratio, coef=coef).loss) != pytest.approx(want / n, rel=1e-3)


# ---------------------------------------------------------------- off-policy weights, written out per token


def ref_token_and_slope(name, lp, old, a, selected, lo, hi, coef):
    """One token's loss and its derivative in log pi, by hand: PPO's surrogate has slope -A*r while unclipped and 0
    when the clip holds it; KL-Cov's base is -A*r, plus coef*|d| (slope coef*sign(d)) when selected; Clip-Cov's
    selected tokens drop out of the sum (value and slope 0; they stay in the mean's count)."""
    d = max(-20.0, min(20.0, lp - old))
    r = math.exp(d)
    if name == "kl_cov":
        pen = coef * abs(d) if selected else 0.0
        return -a * r + pen, -a * r + (coef * math.copysign(1.0, d) if selected else 0.0)
    value, clipped = ref_ppo_token(lp, old, a, lo, hi)
    if name == "clip_cov" and selected:
        return 0.0, 0.0
    return value, 0.0 if clipped else -a * r


@pytest.mark.parametrize("name", ["ppo", "clip_cov", "kl_cov"])
def test_is_weights_multiply_each_token_and_a_rejected_token_is_never_chosen(name):
    """Loss and gradient with off-policy weights against the per-token reference times the weight, the mean taken
    over every valid token (rejected ones included); Clip-Cov and KL-Cov choose only among tokens weighing > 0."""
    lp, old, adv, mask = batch(seed=11, B=6, L=8, spread=0.4)
    lo = hi = 0.2 if name == "ppo" else 1.0  # Clip-Cov at the paper's clip of 1, so its candidates are plentiful
    L = as_lists(lp, old, adv, mask)
    toks = _valid_tokens(L[3])
    cov = ref_cov(L[0], L[2], L[3])
    # rejected: the response holding the largest covariance (KL-Cov's first choice) or a Clip-Cov candidate
    cands = ref_clip_cov_candidates(*L, 1.0, 5.0, lo, hi)
    row = min(cands)[0] if name == "clip_cov" else max(cov, key=cov.get)[0]
    g = torch.Generator().manual_seed(12)
    weights = (0.2 + 1.8 * torch.rand(lp.shape, generator=g)) * mask
    weights[row] = 0.0
    weights[(row + 1) % 6, 1] = 0.0  # and one token of another response
    live = [(b, t) for b, t in toks if weights[b, t] > 0]
    if name == "kl_cov":
        k = max(1, math.floor(0.25 * len(toks)))  # K from every valid token
        want_sel = set(sorted(live, key=cov.get, reverse=True)[:k])
        assert want_sel != set(sorted(toks, key=cov.get, reverse=True)[:k])  # the rejection changes the choice
        call = {"ratio": 0.25, "coef": 0.7}
    elif name == "clip_cov":
        want_sel = {x for x in cands if x in live}  # ratio 1: every live candidate
        assert want_sel != cands and want_sel  # a candidate sits among the rejected tokens
        call = {"ratio": 1.0, "clip_low": lo, "clip_high": hi}
    else:
        want_sel, call = set(), {"clip_low": lo, "clip_high": hi}
    x = lp.clone().requires_grad_(True)
    out = {"ppo": ppo_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}[name](
        x, old, adv, mask, is_weights=weights, **call
    )
    if name != "ppo":
        assert {tuple(s) for s in out.selected.nonzero().tolist()} == want_sel
    out.loss.backward()
    total = 0.0
    for b, t in toks:
        w = float(weights[b, t])
        value, slope = ref_token_and_slope(name, L[0][b][t], L[1][b][t], L[2][b][t], (b, t) in want_sel, lo, hi, 0.7)
        total += value * w
        assert x.grad[b, t].item() == pytest.approx(slope * w / len(toks), rel=1e-5, abs=1e-9), (b, t)
    assert out.loss.item() == pytest.approx(total / len(toks), rel=1e-5)
    assert torch.all(x.grad[mask == 0] == 0)
