"""entropy_openrlhf.algorithms.off_policy against a second implementation: a per-row loop over plain Python floats
(fp64) that follows docs/algorithms/off_policy.md's definitions, on random batches with padding, holes, empty responses,
out-of-range log ratios and garbage (NaN/Inf) on padding."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch

from entropy_openrlhf.algorithms.off_policy import (
    IS_LEVELS,
    PRESETS,
    REJECT_MODES,
    OffPolicyConfig,
    correct,
    default_for,
    metrics_by_staleness,
    preset,
    selection_by_staleness,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms" / "off_policy.md"
SEEDS = (0, 1, 2)
METRIC_KEYS = (
    "kl_k1",
    "kl_k3",
    "rejected_frac",
    "ess",
    "weight_mean",
    "weight_max",
    "clipped_high_frac",
    "clipped_low_frac",
)


def make_batch(seed: int, b: int = 24, length: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """old, rollout, mask: per-row gap scales from numerics-sized to badly stale, so every band keeps some rows
    and drops others; rows 0 and 1 empty; some log ratios beyond the +-20 clamp; NaN/Inf on padding."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, length, generator=g) * 5
    scale = torch.empty(b, 1).uniform_(0.002, 0.8, generator=g)
    old = rollout + torch.randn(b, length, generator=g) * scale
    lengths = torch.randint(1, length + 1, (b,), generator=g)
    lengths[:2] = 0
    mask = (torch.arange(length) < lengths[:, None]) & (torch.rand(b, length, generator=g) > 0.15)
    mask[2] = False
    mask[2, 0] = True  # a one-token response
    old[3, 0] = rollout[3, 0] + 30.0  # beyond the clamp both ways
    old[4, 0] = rollout[4, 0] - 30.0
    mask[3, 0] = mask[4, 0] = True
    old = torch.where(mask, old, torch.tensor(float("nan")))
    rollout = torch.where(mask, rollout, torch.tensor(float("inf")))
    return old, rollout, mask


def reference(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig):
    """weights, keep (lists of lists) and the metrics, one row and one token at a time in Python floats."""
    b, length = mask.shape
    o, r_, m = old.tolist(), rollout.tolist(), mask.tolist()
    if cfg.bypass:  # the rollout's log-probs are pi_old
        o = r_
    weights = [[0.0] * length for _ in range(b)]
    keep = [[False] * length for _ in range(b)]
    k1, k3, rejected, high, low, ws = [], [], [], [], [], []
    for i in range(b):
        idx = [t for t in range(length) if m[i][t]]
        logs = [min(max(o[i][t] - r_[i][t], -20.0), 20.0) for t in idx]
        total = sum(logs)
        for t, lg in zip(idx, logs):
            ratio = math.exp(lg)
            if cfg.is_level == "none":
                raw, w = 1.0, 1.0
            else:
                raw = ratio if cfg.is_level == "token" else math.exp(total)
                w = min(max(raw, cfg.is_min), cfg.is_max)
                high.append(raw > cfg.is_max)
                low.append(raw < cfg.is_min)
            if cfg.reject == "none":
                kept = True
            else:
                stat = {"token": ratio, "sequence_geo": math.exp(total / len(logs)), "sequence": math.exp(total)}[
                    cfg.reject
                ]
                kept = cfg.reject_min <= stat <= cfg.reject_max
            weights[i][t] = w if kept else 0.0
            keep[i][t] = kept
            k1.append(-lg)
            k3.append(ratio - 1 - lg)
            rejected.append(not kept)
            ws.append(weights[i][t])
    n = len(ws)
    mean = lambda xs: sum(xs) / n if n else 0.0
    metrics = {
        "kl_k1": mean(k1),
        "kl_k3": mean(k3),
        "rejected_frac": mean(rejected),
        "ess": sum(ws) ** 2 / (n * sum(w * w for w in ws)) if n and any(ws) else 0.0,
        "weight_mean": mean(ws),
        "weight_max": max(ws) if n else 0.0,
        "clipped_high_frac": mean(high),
        "clipped_low_frac": mean(low),
    }
    return weights, keep, metrics


def assert_matches(old, rollout, mask, cfg):
    out = correct(old, rollout, mask, cfg)
    weights, keep, metrics = reference(old, rollout, mask, cfg)
    assert out.weights.dtype == torch.float32 and out.keep.dtype == torch.bool
    assert torch.equal(out.keep, torch.tensor(keep))
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    for key in METRIC_KEYS:
        assert math.isfinite(out.metrics[f"offpolicy/{key}"]), key
        assert out.metrics[f"offpolicy/{key}"] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    return out


BANDS = (
    dict(is_min=0.0, is_max=2.0, reject_min=0.5, reject_max=2.0),
    dict(is_min=0.8, is_max=1.3, reject_min=0.9, reject_max=1.1),
)


@pytest.mark.parametrize("is_level,reject", list(itertools.product(IS_LEVELS, REJECT_MODES)))
@pytest.mark.parametrize("band", range(len(BANDS)))
def test_correct_matches_reference(is_level, reject, band):
    cfg = OffPolicyConfig(is_level=is_level, reject=reject, **BANDS[band])
    for seed in SEEDS:
        old, rollout, mask = make_batch(seed)
        out = assert_matches(old, rollout, mask, cfg)
        # the batch must exercise the mode, else the comparison proves nothing
        if reject != "none":
            assert 0 < out.metrics["offpolicy/rejected_frac"] < 1
        if is_level != "none":
            assert out.metrics["offpolicy/clipped_high_frac"] > 0
            assert (out.metrics["offpolicy/clipped_low_frac"] > 0) == (BANDS[band]["is_min"] > 0)
        assert not out.keep[:2].any() and not out.weights[:2].any()  # empty responses
        assert not out.keep[~mask].any() and not out.weights[~mask].any()  # padding


def test_presets_match_reference():
    for seed, cfg in itertools.product(SEEDS, PRESETS.values()):
        assert_matches(*make_batch(seed), cfg)


def test_sequence_modes_read_sum_and_mean():
    """One response of 10 tokens, each at ratio 1.2: the geometric mean is 1.2, the product 1.2^10 = 6.2."""
    old, rollout, mask = torch.full((1, 10), math.log(1.2)), torch.zeros(1, 10), torch.ones(1, 10, dtype=torch.bool)
    band = dict(reject_min=0.5, reject_max=2.0)
    assert correct(old, rollout, mask, OffPolicyConfig(reject="sequence_geo", **band)).keep.all()
    assert not correct(old, rollout, mask, OffPolicyConfig(reject="sequence", **band)).keep.any()
    w = correct(old, rollout, mask, OffPolicyConfig(is_level="sequence", is_max=10.0)).weights
    torch.testing.assert_close(w, torch.full((1, 10), 1.2**10))


def test_no_valid_tokens_gives_zeros_not_nan():
    old, rollout, mask = torch.full((3, 5), float("nan")), torch.full((3, 5), float("-inf")), torch.zeros(3, 5)
    for cfg in [*PRESETS.values(), OffPolicyConfig(is_level="sequence", reject="sequence_geo")]:
        out = correct(old, rollout, mask, cfg)
        assert not out.keep.any() and torch.equal(out.weights, torch.zeros(3, 5))
        assert all(v == 0.0 for v in out.metrics.values()), out.metrics


def test_outputs_detached_fp32_from_bf16_inputs():
    old, rollout, mask = make_batch(0)
    valid = mask.clone()
    old = torch.where(valid, old, 0.0).bfloat16().requires_grad_()
    rollout = torch.where(valid, rollout, 0.0).bfloat16()
    out = correct(old, rollout, mask.float(), PRESETS["token_tis"])  # a float 0/1 mask works as well
    assert out.weights.dtype == torch.float32 and not out.weights.requires_grad
    assert torch.isfinite(out.weights).all()
    # the same as the fp32 computation on the bf16-rounded values
    ref = correct(old.detach().float(), rollout.float(), valid, PRESETS["token_tis"])
    assert torch.equal(out.weights, ref.weights)


def test_infinite_cap_stays_finite():
    old, rollout, mask = make_batch(1)
    out = correct(old, rollout, mask, OffPolicyConfig(is_level="sequence", is_max=math.inf))
    assert torch.isfinite(out.weights).all() and all(math.isfinite(v) for v in out.metrics.values())


def test_bypass_weighs_every_valid_token_one():
    old, rollout, mask = make_batch(2)
    out = correct(old, rollout, mask, PRESETS["bypass"])
    assert torch.equal(out.keep, mask) and torch.equal(out.weights, mask.float())
    m = out.metrics
    assert m["offpolicy/kl_k1"] == m["offpolicy/kl_k3"] == m["offpolicy/rejected_frac"] == 0.0
    assert m["offpolicy/ess"] == pytest.approx(1.0) and m["offpolicy/weight_max"] == 1.0


def test_ess_of_known_weights():
    """Token weights 1, 1, 2, 0 (rejected): (4)^2 / (4 * 6) = 2/3."""
    lg = torch.tensor([[0.0, 0.0, math.log(2.0), math.log(8.0)]])
    cfg = OffPolicyConfig(is_level="token", is_max=4.0, reject="token", reject_min=0.5, reject_max=4.0)
    out = correct(lg, torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), cfg)
    assert out.metrics["offpolicy/ess"] == pytest.approx(2 / 3)
    assert out.metrics["offpolicy/rejected_frac"] == pytest.approx(0.25)
    assert out.metrics["offpolicy/clipped_high_frac"] == pytest.approx(0.25)  # read before rejection


def test_shape_mismatch_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        correct(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), PRESETS["none"])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(is_level="seq"), "is_level"),
        (dict(reject="geometric"), "reject"),
        (dict(is_min=-0.1), "is_min"),
        (dict(is_max=-1.0), "is_max"),
        (dict(reject_min=-0.5), "reject_min"),
        (dict(reject_max=-2.0, reject_min=-3.0), "reject_min"),
        (dict(reject_max=-2.0), "reject_max"),
        (dict(is_max=float("nan")), "is_max"),
        (dict(is_min=3.0, is_max=2.0), "is_min"),
        (dict(reject_min=0.9, reject_max=0.8), "reject_min"),
        (dict(is_max=0.9), "is_max"),
        (dict(reject_min=0.5, reject_max=0.9), "reject_max"),
        (dict(reject_min=1.1, reject_max=2.0), "reject_min"),
        (dict(bypass=True, is_level="token"), "is_level"),
        (dict(bypass=True, reject="sequence_geo"), "reject"),
    ],
)
def test_bad_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"offpolicy\.{field}\b"):
        OffPolicyConfig(**kwargs)


def test_bypass_error_names_bypass_too():
    with pytest.raises(ValueError, match=r"offpolicy\.bypass"):
        OffPolicyConfig(bypass=True, is_level="sequence")


def test_boundary_settings_accepted():
    OffPolicyConfig(is_min=1.0, is_max=1.0, reject_min=1.0, reject_max=1.0)
    OffPolicyConfig(is_min=0.0, is_max=math.inf, reject_min=0.0, reject_max=math.inf)


DOCUMENTED = {
    "none": dict(is_level="none", reject="none", bypass=False),
    "token_tis": dict(is_level="token", is_min=0.0, is_max=2.0, reject="none", bypass=False),
    "seq_tis": dict(is_level="sequence", is_min=0.0, is_max=2.0, reject="none", bypass=False),
    "token_mask": dict(is_level="token", is_min=0.0, is_max=5.0, reject="token", reject_min=0.5, reject_max=5.0),
    "geo_mask": dict(is_level="none", reject="sequence_geo", reject_min=0.99, reject_max=1.01, bypass=False),
    "bypass": dict(is_level="none", reject="none", bypass=True),
}


def test_presets_have_documented_values():
    assert set(PRESETS) == set(DOCUMENTED)
    docs = DOCS.read_text()
    for name, values in DOCUMENTED.items():
        cfg = preset(name)
        assert cfg is PRESETS[name] and isinstance(cfg, OffPolicyConfig)
        assert {k: getattr(cfg, k) for k in values} == values, name
        assert f"`{name}`" in docs, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["token_tis"].is_max = 3.0  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"offpolicy\.preset"):
        preset("tis")


def test_the_default_is_token_tis_capped_at_2_when_async_and_none_when_synchronous():
    cfg = default_for(True)
    assert (cfg.is_level, cfg.is_min, cfg.is_max, cfg.reject, cfg.bypass) == ("token", 0.0, 2.0, "none", False)
    assert default_for(False) == PRESETS["none"]
    # the same weights as the trainer's former inline correction: exp(clamp(old - rollout)).clamp(max=cap)
    old, rollout, mask = make_batch(0)
    legacy = torch.exp((old - rollout).clamp(-20, 20)).clamp(max=2.0)
    torch.testing.assert_close(correct(old, rollout, mask, cfg).weights[mask], legacy[mask])


def test_metrics_by_staleness_splits_rows():
    old, rollout, mask = make_batch(0)
    fresh_gap = (old - rollout) * 0.01  # numerics only
    staleness = torch.tensor([0, 1, 2] * (mask.shape[0] // 3))
    old = torch.where((staleness == 0)[:, None], rollout + fresh_gap, old)
    cfg = OffPolicyConfig(is_level="token", reject="sequence_geo", reject_min=0.9, reject_max=1.1)
    out = metrics_by_staleness(old, rollout, mask, staleness, cfg)
    assert {k.split("/")[1] for k in out} == {"staleness_0", "staleness_1", "staleness_2"}
    total = int(mask.sum())
    for v in (0, 1, 2):
        rows = staleness == v
        _, _, ref = reference(old[rows], rollout[rows], mask[rows], cfg)
        for key in ("kl_k1", "kl_k3", "rejected_frac", "ess"):
            assert out[f"offpolicy/staleness_{v}/{key}"] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (v, key)
        assert out[f"offpolicy/staleness_{v}/token_frac"] == pytest.approx(int(mask[rows].sum()) / total)
    # the fresh rows are the numerics: a far smaller gap, nothing rejected
    assert out["offpolicy/staleness_0/kl_k3"] < 0.01 * out["offpolicy/staleness_1/kl_k3"]
    assert out["offpolicy/staleness_0/rejected_frac"] == 0 < out["offpolicy/staleness_1/rejected_frac"]
    with pytest.raises(ValueError, match="staleness"):
        metrics_by_staleness(old, rollout, mask, staleness[:-1], cfg)


def test_metrics_by_staleness_splits_the_tokens_of_a_partial_rollout():
    """Streamed samples carry a staleness per token: a response sampled by two versions gives its older tokens to
    one group and its newer ones to the other; each group's metrics are those of its own tokens."""
    old, rollout, mask = make_batch(1)
    b, length = mask.shape
    staleness = torch.zeros(b, length, dtype=torch.long)
    staleness[:, : length // 2] = 2  # every response's first half sampled two versions back
    staleness[::3] = 1  # and a third of them entirely one version back
    cfg = OffPolicyConfig(is_level="token", is_max=5.0, reject="token", reject_min=0.5, reject_max=5.0)
    out = metrics_by_staleness(old, rollout, mask, staleness, cfg)
    total = int(mask.sum())
    for v in (0, 1, 2):
        tokens = mask * (staleness == v)
        _, _, ref = reference(old, rollout, tokens, cfg)
        for key in ("kl_k1", "kl_k3", "rejected_frac", "ess"):
            assert out[f"offpolicy/staleness_{v}/{key}"] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (v, key)
        assert out[f"offpolicy/staleness_{v}/token_frac"] == pytest.approx(int(tokens.sum()) / total)
    assert sum(out[f"offpolicy/staleness_{v}/token_frac"] for v in (0, 1, 2)) == pytest.approx(1.0)
    # a staleness found only on padding makes no group of its own
    staleness[~mask.bool()] = 7
    assert "offpolicy/staleness_7/kl_k1" not in metrics_by_staleness(old, rollout, mask, staleness, cfg)


def test_selection_by_staleness_is_each_age_s_share_of_the_selected_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    staleness = torch.tensor([[2, 2, 0, 5], [1, 1, 0, 0]])  # 5 sits on padding
    selected = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1]], dtype=torch.bool)  # the padded cell does not count
    out = selection_by_staleness(selected, mask, staleness)
    assert out == {
        "cov/staleness_0/selected_share": pytest.approx(1 / 4),
        "cov/staleness_1/selected_share": pytest.approx(1 / 4),
        "cov/staleness_2/selected_share": pytest.approx(2 / 4),
    }
    # per response: every token of a response has its staleness
    assert selection_by_staleness(selected, mask, torch.tensor([3, 0])) == {
        "cov/staleness_0/selected_share": pytest.approx(2 / 4),
        "cov/staleness_3/selected_share": pytest.approx(2 / 4),
    }
    assert selection_by_staleness(torch.zeros_like(selected), mask, staleness) == {}
