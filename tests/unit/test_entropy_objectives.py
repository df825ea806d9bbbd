"""SAPO, DPPO, CE-GPPO and the entropy-based advantage, checked against an independent scalar implementation (plain
Python floats in fp64, loops over tokens, written from docs/algorithms/losses.md): the loss, every token's loss, the
selection, the metrics and the gradient with respect to the log-probs, on random inputs with padding that holds
NaN/Inf, holes inside responses, empty rows, every aggregation mode, a global normaliser split over ranks, importance
weights and log ratios beyond +-20; then the properties the objectives are built for, their validation, their
wiring through the registry and the config, and the policy actor's use of the entropy-based advantage."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from entropy_openrlhf.algorithms.advantages import entropy_advantage, entropy_advantage_metrics
from entropy_openrlhf.algorithms.loss_terms import AGG_MODES, aggregate
from entropy_openrlhf.algorithms.losses import ce_gppo_loss, dppo_loss, ppo_loss, sapo_loss
from entropy_openrlhf.algorithms.objectives import OBJECTIVES, LossContext, get_objective, run_objective
from entropy_openrlhf.config import ConfigError, build_parser, from_args, validate
from entropy_openrlhf.presets import PIPELINES

NAN, INF = float("nan"), float("inf")
NAMES = ["sapo", "dppo", "ce_gppo"]

# ---------------------------------------------------------------- independent reference (scalar Python, fp64)


def valid_tokens(mask):
    return [(b, t) for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]


def clamp20(x):
    return max(-20.0, min(20.0, x))


def ref_coefficients(mask, agg, normalizer=None, dp_size=1):
    """{token: c_t}, the weight of each valid token's loss in the aggregate (the loss is sum_t l_t c_t)."""
    width = len(mask[0])
    rows = {b: sum(1 for t in range(width) if mask[b][t]) for b in range(len(mask))}
    n_tok = sum(rows.values())
    n_seq = sum(1 for n in rows.values() if n > 0)
    scale = 1.0 if normalizer is None else float(dp_size)
    coef = {}
    for b, t in valid_tokens(mask):
        if agg == "token_mean":
            c = 1.0 / max(n_tok if normalizer is None else normalizer, 1.0)
        elif agg == "seq_mean_token_mean":
            c = 1.0 / (max(rows[b], 1) * max(n_seq if normalizer is None else normalizer, 1.0))
        elif agg == "seq_mean_token_sum":
            c = 1.0 / max(n_seq if normalizer is None else normalizer, 1.0)
        else:  # seq_mean_token_sum_norm: the matrix's width stands for the constant length
            c = 1.0 / max(n_seq * width if normalizer is None else normalizer, 1.0)
        coef[b, t] = scale * c
    return coef


def ref_cov_metrics(lp, adv, mask, selected):
    toks = valid_tokens(mask)
    if not toks:
        return {"cov_mean": 0.0, "cov_p99": 0.0, "cov_max": 0.0, "cov_selected_mean": 0.0}
    a_mean = sum(adv[b][t] for b, t in toks) / len(toks)
    l_mean = sum(lp[b][t] for b, t in toks) / len(toks)
    cov = {(b, t): (adv[b][t] - a_mean) * (lp[b][t] - l_mean) for b, t in toks}
    vals = sorted(cov.values())
    pos = 0.99 * (len(vals) - 1)  # linear interpolation, torch.quantile's default
    i = int(math.floor(pos))
    p99 = vals[i] + (vals[min(i + 1, len(vals) - 1)] - vals[i]) * (pos - i)
    sel = [cov[k] for k in selected]
    return {
        "cov_mean": sum(vals) / len(vals),
        "cov_p99": p99,
        "cov_max": vals[-1],
        "cov_selected_mean": sum(sel) / len(sel) if sel else 0.0,
    }


def ppo_kl(lp, old, mask):
    toks = valid_tokens(mask)
    return sum(old[b][t] - lp[b][t] for b, t in toks) / max(len(toks), 1)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_sapo_token(lp, old, a, tau_pos, tau_neg):
    """(loss, d loss / d lp, gate attenuation 4 s (1 - s)) of one token."""
    raw = lp - old
    r = math.exp(clamp20(raw))
    tau = tau_pos if a > 0 else tau_neg
    s = sigmoid(tau * (r - 1.0))
    grad = -a * 4.0 * s * (1.0 - s) * r if abs(raw) <= 20.0 else 0.0
    return -(4.0 / tau) * s * a, grad, 4.0 * s * (1.0 - s)


DELTA = {"tv": 0.15, "kl": 0.05}


def ref_dppo_token(lp, old, a, divergence, d_low, d_high, tis_cap):
    """(loss, d loss / d lp, kept, divergence, distance of the mask's test from its threshold) of one token."""
    p, pbar = math.exp(min(lp, 0.0)), math.exp(min(old, 0.0))
    if divergence == "tv":
        div = abs(p - pbar)
        out_high, out_low = p - pbar > d_high, p - pbar < -d_low
        margin = min(abs(p - pbar - d_high), abs(p - pbar + d_low))
    else:
        div = pbar * (min(old, 0.0) - min(lp, 0.0)) + (1 - pbar) * math.log((1 - pbar + 1e-8) / (1 - p + 1e-8))
        out_high, out_low = div > d_high and p > pbar, div > d_low and p < pbar
        margin = min(abs(div - d_high), abs(div - d_low))
    kept = not ((a > 0 and out_high) or (a < 0 and out_low))
    r = math.exp(clamp20(lp - old))
    weight = r if tis_cap is None else min(r, tis_cap)
    if not kept:
        return 0.0, 0.0, False, div, margin, False
    return -a * weight * lp, -a * weight, True, div, margin, tis_cap is not None and r > tis_cap


def ref_ce_gppo_token(lp, old, a, cl, ch, bl, bh, dual):
    """(loss, d loss / d lp, branch, dual bound binds, distance of the ratio from a clip bound) of one token."""
    raw = lp - old
    r = math.exp(clamp20(raw))
    margin = min(abs(r - (1 - cl)), abs(r - (1 + ch)))
    if a < 0 and r < 1 - cl:
        loss, grad, branch = -bl * (1 - cl) * a, -bl * (1 - cl) * a, "low"
    elif a > 0 and r > 1 + ch:
        loss, grad, branch = -bh * (1 + ch) * a, -bh * (1 + ch) * a, "high"
    else:
        loss, grad, branch = -r * a, (-r * a if abs(raw) <= 20.0 else 0.0), "ppo"
    bound = dual is not None and a < 0 and loss > -a * dual
    if bound:
        loss, grad = -a * dual, 0.0
    return loss, grad, branch, bound, margin


def ref_loss(name, lp, old, adv, mask, w=None, agg=None, normalizer=None, dp_size=1, **kw):
    """(loss, {token: l_t}, {token: dloss/dlp_t}, selected set, metrics, tokens near a decision threshold)."""
    agg = agg or ("seq_mean_token_mean" if name == "sapo" else "token_mean")
    coef = ref_coefficients(mask, agg, normalizer, dp_size)
    toks = valid_tokens(mask)
    n = max(len(toks), 1)
    token, grad, selected, near = {}, {}, set(), set()
    counts = {k: 0 for k in ("gate", "masked_high", "masked_low", "tis", "div", "low", "high", "dual")}
    for b, t in toks:
        x, y, a = lp[b][t], old[b][t], adv[b][t]
        wt = 1.0 if w is None else w[b][t]
        if name == "sapo":
            loss_t, g, gate = ref_sapo_token(x, y, a, kw.get("tau_pos", 1.0), kw.get("tau_neg", 1.05))
            counts["gate"] += gate
            selected.add((b, t))
        elif name == "dppo":
            divergence = kw.get("divergence", "tv")
            d_low = kw.get("delta_low") if kw.get("delta_low") is not None else DELTA[divergence]
            d_high = kw.get("delta_high") if kw.get("delta_high") is not None else DELTA[divergence]
            loss_t, g, kept, div, margin, tis = ref_dppo_token(
                x, y, a, divergence, d_low, d_high, kw.get("tis_cap", 20.0)
            )
            counts["div"] += div
            if kept:
                selected.add((b, t))
                counts["tis"] += tis
            else:
                counts["masked_high" if a > 0 else "masked_low"] += 1
            if margin < 1e-5 and a != 0:
                near.add((b, t))
        else:
            cl, ch = kw.get("clip_low", 0.2), kw.get("clip_high", 0.2)
            bl, bh = kw.get("beta_low", 0.75), kw.get("beta_high", 1.0)
            loss_t, g, branch, bound, margin = ref_ce_gppo_token(x, y, a, cl, ch, bl, bh, kw.get("dual_clip"))
            counts[branch] = counts.get(branch, 0) + 1
            counts["dual"] += bound
            if branch != "ppo" and not bound:
                selected.add((b, t))
            if margin < 1e-5:
                near.add((b, t))
        token[b, t] = loss_t * wt
        grad[b, t] = g * wt * coef[b, t]
    total = sum(token[k] * coef[k] for k in toks)
    metrics = {"ppo_kl": ppo_kl(lp, old, mask), **ref_cov_metrics(lp, adv, mask, selected)}
    if name == "sapo":
        metrics["sapo_gate_mean"] = counts["gate"] / n
    elif name == "dppo":
        metrics.update(
            dppo_masked_frac=(counts["masked_high"] + counts["masked_low"]) / n,
            dppo_masked_frac_high=counts["masked_high"] / n,
            dppo_masked_frac_low=counts["masked_low"] / n,
            dppo_tis_frac=counts["tis"] / n,
            dppo_divergence_mean=counts["div"] / n,
        )
    else:
        metrics.update(
            ce_gppo_clip_frac_low=counts["low"] / n,
            ce_gppo_clip_frac_high=counts["high"] / n,
            dual_clip_frac=counts["dual"] / n,
        )
    return total, token, grad, selected, metrics, near


def ref_entropy_advantage(adv, ent, mask, alpha, kappa):
    width = len(mask[0])
    return [
        [adv[b][t] + min(alpha * ent[b][t], abs(adv[b][t]) / kappa) if mask[b][t] else 0.0 for t in range(width)]
        for b in range(len(mask))
    ]


# ---------------------------------------------------------------- random inputs


def dirty(x, mask, shift=0):
    """x with NaN / +inf / -inf wherever the mask is 0."""
    garbage = torch.tensor([NAN, INF, -INF])[(torch.arange(x.numel()) + shift) % 3].view_as(x)
    return torch.where(mask.bool(), x, garbage)


def make_batch(seed, B=6, L=9, spread=0.5, per_token_adv=False, holes=True, empty_row=True, extreme=True):
    """Log-probs in [-4, 0], an old policy `spread` nats away, advantages per response (GRPO) or per token (with some
    exact zeros), entropies, IS weights (some 0), and a mask with ragged lengths, holes inside responses and an empty
    row; a few tokens' log ratio beyond +-20; every input holds NaN/Inf where the mask is 0."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g) * 4.0
    old = (lp + torch.randn(B, L, generator=g) * spread).clamp(max=0.0)
    if per_token_adv:
        adv = torch.randn(B, L, generator=g) * 1.5
        adv = torch.where(torch.rand(B, L, generator=g) < 0.1, 0.0, adv)
    else:
        adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, L).contiguous()
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    if holes:
        mask = mask * (torch.rand(B, L, generator=g) > 0.15).float()
    if empty_row:
        mask[int(torch.randint(0, B, (1,), generator=g))] = 0.0
    if extreme:  # log ratios of -25 and +25 (old far above / below), one each where valid
        cells = mask.nonzero()
        if len(cells) >= 2:
            (b0, t0), (b1, t1) = cells[0].tolist(), cells[-1].tolist()
            lp[b0, t0], old[b0, t0] = -25.5, -0.5
            lp[b1, t1], old[b1, t1] = -0.5, -25.5
    ent = torch.rand(B, L, generator=g) * 3.0
    w = torch.rand(B, L, generator=g) * 2.0
    w = torch.where(torch.rand(B, L, generator=g) < 0.1, 0.0, w)
    return {
        "lp": dirty(lp, mask),
        "old": dirty(old, mask, 1),
        "adv": dirty(adv, mask, 2),
        "mask": mask,
        "ent": dirty(ent, mask),
        "w": dirty(w, mask, 1),
    }


def lists(*ts):
    return [t.tolist() for t in ts]


def as_set(sel):
    return {tuple(x) for x in sel.nonzero().tolist()}


def dense(values, shape):
    out = torch.zeros(shape, dtype=torch.float64)
    for (b, t), v in values.items():
        out[b, t] = v
    return out


FUNCTIONS = {"sapo": sapo_loss, "dppo": dppo_loss, "ce_gppo": ce_gppo_loss}

# each objective's settings to check, defaults first; each unlike its partner where it has one
SETTINGS = {
    "sapo": [{}, {"tau_pos": 0.5, "tau_neg": 2.0}],
    "dppo": [
        {},
        {"divergence": "kl"},
        {"delta_low": 0.05, "delta_high": 0.3, "tis_cap": 1.5},
        {"divergence": "kl", "delta_low": 0.2, "delta_high": 0.01, "tis_cap": None},
    ],
    "ce_gppo": [
        {},
        {"clip_low": 0.1, "clip_high": 0.28, "beta_low": 0.5, "beta_high": 1.0, "dual_clip": 3.0},
        {"beta_low": 0.0, "beta_high": 2.0, "dual_clip": 1.2},
    ],
}
CASES = [(name, i) for name in NAMES for i in range(len(SETTINGS[name]))]


def run_loss(name, x, agg=None, normalizer=None, dp_size=1, weights=True, **kw):
    """The implementation on batch `x`, its log-probs a fresh leaf: (output, gradient)."""
    lp = x["lp"].clone().requires_grad_(True)
    extra = {} if agg is None else {"agg": agg}
    out = FUNCTIONS[name](
        lp, x["old"], x["adv"], x["mask"], normalizer=normalizer, dp_size=dp_size,
        is_weights=x["w"] if weights else None, **extra, **kw,
    )  # fmt: skip
    out.loss.backward()
    return out, lp.grad


def check_against_reference(name, x, agg=None, normalizer=None, dp_size=1, weights=True, **kw):
    out, grad = run_loss(name, x, agg, normalizer, dp_size, weights, **kw)
    L = lists(x["lp"], x["old"], x["adv"], x["mask"], x["w"])
    loss, token, want_grad, sel, metrics, near = ref_loss(
        name, *L[:4], w=L[4] if weights else None, agg=agg, normalizer=normalizer, dp_size=dp_size, **kw
    )
    assert not near, f"a token sits on a decision threshold: pick another seed ({near})"
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert torch.allclose(out.token_loss.double(), dense(token, x["mask"].shape), rtol=1e-5, atol=1e-6)
    assert (out.token_loss[~x["mask"].bool()] == 0).all()
    assert out.selected.dtype == torch.bool and as_set(out.selected) == sel
    assert out.metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert math.isfinite(out.metrics[key]), key
        assert out.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert torch.isfinite(grad).all() and (grad[~x["mask"].bool()] == 0).all()
    assert torch.allclose(grad.double(), dense(want_grad, grad.shape), rtol=1e-4, atol=1e-7)
    return out, grad, sel


# ---------------------------------------------------------------- defaults and signatures


def _defaults(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_signature_defaults_are_the_documented_ones():
    common = {"normalizer": None, "dp_size": 1, "is_weights": None}
    assert _defaults(sapo_loss) == {"tau_pos": 1.0, "tau_neg": 1.05, "agg": "seq_mean_token_mean", **common}
    assert _defaults(dppo_loss) == {
        "divergence": "tv", "delta_low": None, "delta_high": None, "tis_cap": 20.0, "agg": "token_mean", **common,
    }  # fmt: skip
    assert _defaults(ce_gppo_loss) == {
        "clip_low": 0.2, "clip_high": 0.2, "beta_low": 0.75, "beta_high": 1.0, "dual_clip": None,
        "agg": "token_mean", **common,
    }  # fmt: skip
    assert _defaults(entropy_advantage) == {"alpha": 0.4, "kappa": 2.0}
    for fn in (sapo_loss, dppo_loss, ce_gppo_loss, entropy_advantage):
        kinds = {p.kind for name, p in inspect.signature(fn).parameters.items() if name in _defaults(fn)}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name,setting", CASES)
def test_matches_the_reference_in_every_aggregation_mode(name, setting, agg):
    kw = SETTINGS[name][setting]
    seen = {"unselected": 0, "selected": 0, "zero_grad": 0}
    for seed in range(8):
        x = make_batch(seed, B=4 + seed % 4, spread=0.6, per_token_adv=seed % 2 == 0)
        out, grad, sel = check_against_reference(name, x, agg=agg, weights=seed % 3 != 0, **kw)
        valid = x["mask"].bool()
        seen["unselected"] += int((valid & ~out.selected).sum())
        seen["selected"] += len(sel)
        seen["zero_grad"] += int((valid & (grad == 0) & (x["adv"] != 0)).sum())
    if name != "sapo":  # every valid token is SAPO's
        assert seen["selected"] > 0 and seen["unselected"] > 0, "the inputs should exercise both sides"
    assert seen["zero_grad"] > 0, "the inputs should hold tokens without a gradient (the clamp, a mask, a bound)"


def test_the_default_aggregation_is_the_sources():
    x = make_batch(3, per_token_adv=True)
    for name, agg in (("sapo", "seq_mean_token_mean"), ("dppo", "token_mean"), ("ce_gppo", "token_mean")):
        default, _ = run_loss(name, x)
        explicit, _ = run_loss(name, x, agg=agg)
        assert default.loss.item() == explicit.loss.item()
        other, _ = run_loss(name, x, agg="seq_mean_token_sum")
        assert other.loss.item() != pytest.approx(default.loss.item(), rel=1e-3)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name,setting", CASES)
def test_a_global_normaliser_over_ranks_makes_the_split_invisible(name, setting, agg):
    """The batch as 2 ranks x 2 micro-batches: each call normalised by the whole batch's count and multiplied by
    dp_size; the ranks' gradients averaged (DeepSpeed) give the gradient of the one unsplit call, and the ranks'
    summed losses averaged give its loss. The reference agrees on each part."""
    kw = SETTINGS[name][setting]
    x = make_batch(11 + setting, B=8, L=10, spread=0.6, per_token_adv=True)
    whole, whole_grad = run_loss(name, x, agg=agg, **kw)
    mask = x["mask"]
    n_seq = float((mask.sum(-1) > 0).sum())
    norm = {"token_mean": float(mask.sum()), "seq_mean_token_sum_norm": n_seq * mask.shape[1]}.get(agg, n_seq)
    lp = x["lp"].clone().requires_grad_(True)
    ranks = [(slice(0, 3), slice(3, 4)), (slice(4, 6), slice(6, 8))]
    total = 0.0
    for rank in ranks:
        for rows in rank:
            part = {k: v[rows] for k, v in x.items()}
            out = FUNCTIONS[name](
                lp[rows], part["old"], part["adv"], part["mask"], agg=agg, normalizer=norm, dp_size=2,
                is_weights=part["w"], **kw,
            )  # fmt: skip
            (out.loss / 2).backward()  # the data-parallel average of the two ranks' gradients
            total += out.loss.item() / 2
            ref = ref_loss(name, *lists(lp[rows].detach(), part["old"], part["adv"], part["mask"]),
                           w=part["w"].tolist(), agg=agg, normalizer=norm, dp_size=2, **kw)  # fmt: skip
            assert out.loss.item() == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert total == pytest.approx(whole.loss.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(lp.grad, whole_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", NAMES)
def test_all_padding_gives_zero_loss_with_a_gradient_path(name):
    lp = torch.full((3, 5), NAN, requires_grad=True)
    garbage = torch.full((3, 5), INF)
    for agg in AGG_MODES:
        out = FUNCTIONS[name](lp, -garbage, garbage, torch.zeros(3, 5), agg=agg, is_weights=garbage)
        assert out.loss.item() == 0.0 and out.loss.requires_grad
        out.loss.backward()
        assert (lp.grad == 0).all()
        assert (out.token_loss == 0).all() and not out.selected.any()
        assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_padding_garbage_changes_nothing_and_inputs_are_not_modified(name):
    x = make_batch(41, B=5, L=8)
    clean = {k: torch.where(x["mask"].bool(), v, 0.0) if k != "mask" else v for k, v in x.items()}
    ref, ref_grad = run_loss(name, clean)
    before = {k: v.clone() for k, v in x.items()}
    out, grad = run_loss(name, x)
    for k, v in x.items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)
    assert out.loss.item() == ref.loss.item()
    assert torch.equal(out.token_loss, ref.token_loss) and torch.equal(out.selected, ref.selected)
    assert torch.equal(grad, ref_grad)
    assert out.metrics == ref.metrics


@pytest.mark.parametrize("name", NAMES)
def test_math_is_fp32_for_bf16_inputs(name):
    x = make_batch(42, spread=0.3)
    low = {k: v.bfloat16() if k in ("lp", "old", "adv", "w") else v for k, v in x.items()}
    out, _ = run_loss(name, low)
    ref, _ = run_loss(name, {k: v.float() for k, v in low.items()})
    assert out.loss.dtype == torch.float32 and out.token_loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)


def test_log_ratios_beyond_20_are_clamped_where_the_ratio_carries_the_gradient():
    """One token 25 nats above its old log-prob (A < 0) and one 25 below (A > 0). SAPO and CE-GPPO's PPO branch
    differentiate the clamped ratio: no gradient. DPPO's weight is sg(min(e^20, tis_cap)) on the raw log-prob, so it
    keeps -A * tis_cap (its A < 0 token is inside the region: its probability rose; the A > 0 one is too: it fell).
    CE-GPPO's low/high branches go through the raw log-prob at any ratio."""
    lp = torch.tensor([[-0.5, -26.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-25.5, -1.0, -1.0]])
    adv = torch.tensor([[-1.0, 2.0, 0.5]])
    mask = torch.ones(1, 3)
    for fn in (sapo_loss, ce_gppo_loss):
        lp.grad = None
        kw = {"beta_low": 0.0, "beta_high": 0.0} if fn is ce_gppo_loss else {}
        fn(lp, old, adv, mask, **kw).loss.backward()
        assert lp.grad[0, :2].tolist() == [0.0, 0.0] and lp.grad[0, 2] != 0
    lp.grad = None
    out = dppo_loss(lp, old, adv, mask)
    out.loss.backward()
    assert out.selected.all()
    assert lp.grad[0].tolist() == pytest.approx([20.0 / 3, -2.0 * math.exp(-20.0) / 3, -0.5 / 3], rel=1e-5)
    assert out.metrics["dppo_tis_frac"] == pytest.approx(1 / 3)
    lp.grad = None
    ce_gppo_loss(lp, old, adv, mask).loss.backward()  # the A > 0 token's ratio is e^-20: PPO's branch, clamped
    assert lp.grad[0, 1] == 0.0
    lp.grad = None
    up = torch.tensor([[-0.5]], requires_grad=True)  # A > 0, ratio e^20 > 1 + clip_high: the high branch
    ce_gppo_loss(up, torch.tensor([[-25.5]]), torch.tensor([[1.0]]), torch.ones(1, 1)).loss.backward()
    assert up.grad.item() == pytest.approx(-1.2)


# ---------------------------------------------------------------- the properties each objective is built for


@pytest.mark.parametrize("agg", AGG_MODES)
def test_sapo_at_ratio_one_has_the_plain_policy_gradient(agg):
    """On-policy every gate's attenuation 4 s (1 - s) is 1: the gradient is that of -A * w * logp aggregated, for
    either temperature; the value is -2A/tau per token. Off-policy it shrinks but never reaches 0."""
    x = make_batch(5, per_token_adv=True, extreme=False)
    on = {**x, "old": x["lp"]}
    for temps in ({}, {"tau_pos": 0.3, "tau_neg": 3.0}):
        out, grad = run_loss("sapo", on, agg=agg, **temps)
        plain_lp = x["lp"].clone().requires_grad_(True)
        valid = x["mask"].bool()
        w = torch.where(valid, x["w"], 0.0)
        reinforce = torch.where(valid, -torch.where(valid, x["adv"], 0.0) * w * plain_lp, 0.0)
        aggregate(reinforce, valid, agg).backward()
        assert torch.allclose(grad, plain_lp.grad, rtol=1e-6, atol=1e-8)
        assert out.metrics["sapo_gate_mean"] == pytest.approx(1.0)
        tau = torch.where(x["adv"] > 0, temps.get("tau_pos", 1.0), temps.get("tau_neg", 1.05))
        want = torch.where(valid, -2.0 * torch.where(valid, x["adv"], 0.0) / tau * w, 0.0)
        assert torch.allclose(out.token_loss, want, rtol=1e-6, atol=1e-7)
    off, off_grad = run_loss("sapo", x, agg=agg)
    moved = x["mask"].bool() & (x["adv"] != 0) & (x["w"] > 0) & ((x["lp"] - x["old"]).abs() > 1e-3)
    assert moved.any() and (off_grad[moved] != 0).all()
    assert off.metrics["sapo_gate_mean"] < 1.0


def test_sapo_fades_faster_for_the_larger_temperature():
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.25]]))  # ratio 2 on both
    for adv, hotter in (([1.0, 1.0], "tau_pos"), ([-1.0, -1.0], "tau_neg")):
        grads = []
        for tau in (0.5, 4.0):
            x = lp.clone().requires_grad_(True)
            sapo_loss(x, old, torch.tensor([adv]), torch.ones(1, 2), **{hotter: tau}).loss.backward()
            grads.append(x.grad.abs().sum().item())
        assert grads[1] < grads[0]


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_masks_only_in_the_direction_the_advantage_pushes(divergence):
    """Per token, from an old probability of 0.5: moved up or down by 0.3 (outside both regions), or by 0.01 (inside
    both), with A > 0, A < 0 or A = 0. Only 'A > 0 and up' and 'A < 0 and down' beyond the region are masked."""
    probs = {"far up": 0.8, "far down": 0.2, "near up": 0.51, "near down": 0.49}
    cases = [(move, a) for move in probs for a in (1.0, -1.0, 0.0)]
    lp = torch.log(torch.tensor([[probs[m] for m, _ in cases]])).requires_grad_(True)
    old = torch.full_like(lp, math.log(0.5))
    adv = torch.tensor([[a for _, a in cases]])
    out = dppo_loss(lp, old, adv, torch.ones_like(old), divergence=divergence)
    masked = {case for case, keep in zip(cases, out.selected[0].tolist()) if not keep}
    assert masked == {("far up", 1.0), ("far down", -1.0)}
    out.loss.backward()
    for (move, a), g in zip(cases, lp.grad[0].tolist()):
        if (move, a) in masked or a == 0:
            assert g == 0.0
        else:
            assert g == pytest.approx(-a * probs[move] / 0.5 / len(cases), rel=1e-5)  # PPO's unclipped -A rho
    assert out.metrics["dppo_masked_frac_high"] == out.metrics["dppo_masked_frac_low"] == pytest.approx(1 / 12)


def test_dppo_thresholds_follow_the_divergence_and_are_probabilities_not_ratio_widths():
    """tv's default region is 0.15 of probability, kl's 0.05 nats of binary KL: a ratio of 10 on a rare token
    (0.01 -> 0.1) stays inside tv's region, where PPO's clip would have stopped it, while a likely token moving
    0.5 -> 0.7 (ratio 1.4) leaves it."""
    before, after = [0.01, 0.5, 0.5, 0.5], [0.1, 0.7, 0.58, 0.64]
    old, lp = torch.log(torch.tensor([before])), torch.log(torch.tensor([after]))
    adv = torch.ones_like(old)
    mask = torch.ones_like(old)
    tv = dppo_loss(lp, old, adv, mask)
    assert tv.selected[0].tolist() == [True, False, True, True]
    assert dppo_loss(lp, old, adv, mask, delta_high=0.1).selected[0].tolist() == [True, False, True, False]

    def kl(pb, p):  # KL(Bern(pb) || Bern(p)): 0.0713, 0.0872, 0.0130, 0.0408 here
        return pb * math.log(pb / p) + (1 - pb) * math.log((1 - pb) / (1 - p))

    divs = [kl(pb, p) for pb, p in zip(before, after)]
    by_kl = dppo_loss(lp, old, adv, mask, divergence="kl")
    assert by_kl.selected[0].tolist() == [d <= 0.05 for d in divs] == [False, False, True, True]
    assert by_kl.metrics["dppo_divergence_mean"] == pytest.approx(sum(divs) / 4, rel=1e-4)
    assert dppo_loss(lp, old, adv, mask, divergence="kl", delta_high=0.03).selected[0].tolist() == [
        False, False, True, False,
    ]  # fmt: skip
    # tv's 0.15 passed to kl is three times kl's default region: nothing here leaves it
    assert dppo_loss(lp, old, adv, mask, divergence="kl", delta_high=0.15).selected.all()


def test_dppo_truncates_the_importance_weight_at_tis_cap_and_keeps_masked_tokens_in_the_denominator():
    lp = torch.log(torch.tensor([[0.09, 0.5, 0.3]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.01, 0.5, 0.6]]))  # ratios 9, 1, 0.5
    adv = torch.tensor([[1.0, 1.0, -1.0]])  # the last token fell by 0.3 with A < 0: masked
    mask = torch.ones(1, 3)
    for cap, w0 in ((20.0, 9.0), (4.0, 4.0), (None, 9.0)):
        lp.grad = None
        out = dppo_loss(lp, old, adv, mask, tis_cap=cap)
        out.loss.backward()
        assert lp.grad[0].tolist() == pytest.approx([-w0 / 3, -1.0 / 3, 0.0], rel=1e-5)
        assert out.metrics["dppo_tis_frac"] == pytest.approx(1 / 3 if cap == 4.0 else 0.0)
        assert out.metrics["dppo_masked_frac"] == pytest.approx(1 / 3)


def test_ce_gppo_with_both_betas_zero_has_ppos_gradient_and_with_one_ppos_value():
    for seed in range(6):
        x = make_batch(seed, spread=0.8, per_token_adv=seed % 2 == 0)
        for clip, dual in (((0.2, 0.2), None), ((0.1, 0.28), 2.0)):
            for agg in AGG_MODES:
                common = dict(clip_low=clip[0], clip_high=clip[1], dual_clip=dual, agg=agg, is_weights=x["w"])
                a = x["lp"].clone().requires_grad_(True)
                b = x["lp"].clone().requires_grad_(True)
                zero = ce_gppo_loss(a, x["old"], x["adv"], x["mask"], beta_low=0.0, beta_high=0.0, **common)
                ppo = ppo_loss(b, x["old"], x["adv"], x["mask"], **common)
                zero.loss.backward()
                ppo.loss.backward()
                assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)
                one = ce_gppo_loss(x["lp"], x["old"], x["adv"], x["mask"], beta_low=1.0, beta_high=1.0, **common)
                assert one.loss.item() == pytest.approx(ppo.loss.item(), rel=1e-6, abs=1e-7)
                assert torch.allclose(one.token_loss, ppo.token_loss, rtol=1e-6, atol=1e-7)


def test_ce_gppo_keeps_a_bounded_gradient_on_the_clipped_tokens():
    """Ratios 0.5 (A < 0: low), 2 (A > 0: high), 1 (PPO's branch): the low token's gradient is
    -beta_low (1 - clip_low) A, the high one's -beta_high (1 + clip_high) A, whatever the ratio; PPO gives both 0.
    A dual clip of 1.5 binds on a fourth token (A < 0, ratio 3): no gradient there."""
    lp = torch.log(torch.tensor([[0.25, 0.5, 0.4, 0.6]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5, 0.25, 0.4, 0.2]]))
    adv = torch.tensor([[-1.0, 2.0, 1.0, -1.0]])
    out = ce_gppo_loss(lp, old, adv, torch.ones(1, 4), beta_low=0.5, beta_high=0.9, dual_clip=1.5)
    out.loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.5 * 0.8 / 4, -0.9 * 1.2 * 2 / 4, -1.0 / 4, 0.0], rel=1e-5)
    assert out.selected[0].tolist() == [True, True, False, False]
    assert out.metrics["ce_gppo_clip_frac_low"] == pytest.approx(1 / 4)
    assert out.metrics["ce_gppo_clip_frac_high"] == pytest.approx(1 / 4)
    assert out.metrics["dual_clip_frac"] == pytest.approx(1 / 4)
    assert out.token_loss[0, 3].item() == pytest.approx(1.5)  # -A * C


# ---------------------------------------------------------------- the entropy-based advantage


@pytest.mark.parametrize("alpha,kappa", [(0.4, 2.0), (0.1, 2.0), (5.0, 1.5), (0.0, 2.0), (1.0, 1.0), (2.0, 10.0)])
def test_entropy_advantage_matches_the_reference(alpha, kappa):
    for seed in range(10):
        x = make_batch(seed, per_token_adv=seed % 2 == 0)
        ent = x["ent"].clone().requires_grad_(True)  # the output must not carry its gradient
        before = {k: v.clone() for k, v in x.items()}
        shaped = entropy_advantage(x["adv"], ent, x["mask"], alpha=alpha, kappa=kappa)
        want = ref_entropy_advantage(*lists(x["adv"], x["ent"], x["mask"]), alpha, kappa)
        assert shaped.dtype == torch.float32 and shaped.shape == x["mask"].shape and not shaped.requires_grad
        assert torch.allclose(shaped.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-7)
        assert torch.isfinite(shaped).all() and (shaped[~x["mask"].bool()] == 0).all()
        for k, v in x.items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)
        m = entropy_advantage_metrics(x["adv"], x["ent"], x["mask"], alpha=alpha, kappa=kappa)
        toks = valid_tokens(x["mask"].tolist())
        adv = x["adv"].tolist()
        assert m["entropy_adv_shift"] == pytest.approx(
            sum(want[b][t] - adv[b][t] for b, t in toks) / len(toks), rel=1e-5, abs=1e-7
        )
        nonzero = [(b, t) for b, t in toks if adv[b][t] != 0]
        capped = [k for k in nonzero if abs(adv[k[0]][k[1]]) / kappa < alpha * x["ent"][k].item()]
        assert m["entropy_adv_capped_frac"] == pytest.approx(len(capped) / len(nonzero))


def test_entropy_advantage_never_flips_a_sign_for_kappa_above_one():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(64, 32, generator=g) * torch.logspace(-4, 1, 32)
    adv[:, :3] = 0.0
    ent = torch.rand(64, 32, generator=g) * 10
    mask = torch.ones(64, 32)
    for kappa in (1.0001, 1.5, 2.0, 100.0):
        for alpha in (0.1, 0.4, 10.0, 1e6):
            shaped = entropy_advantage(adv, ent, mask, alpha=alpha, kappa=kappa)
            assert torch.equal(torch.sign(shaped), torch.sign(adv))
            # the bonus is at most |A| / kappa (A' - A carries fp32 rounding of |A|)
            assert ((shaped - adv) <= adv.abs() / kappa + 1e-6 * adv.abs()).all()
            # a negative advantage is softened to at most A (1 - 1/kappa) (up to fp32 rounding of |A|)
            neg = adv < 0
            assert (shaped[neg] <= (adv * (1 - 1 / kappa) + 1e-6 * adv.abs())[neg]).all()
            assert (shaped[adv == 0] == 0).all()  # all-equal groups get no bonus
    # kappa = 1 lets a negative advantage reach 0 (never past it)
    at_one = entropy_advantage(adv, ent, mask, alpha=1e6, kappa=1.0)
    assert (at_one[adv < 0] == 0).all() and (at_one >= 0).all()


def test_entropy_advantage_is_detached_and_no_longer_zero_mean():
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], requires_grad=True)
    ent = torch.tensor([[0.5, 2.0], [0.5, 2.0]], requires_grad=True)
    shaped = entropy_advantage(adv, ent, torch.ones(2, 2))
    assert not shaped.requires_grad
    # bonuses min(0.4 H, |A| / 2): 0.2 and 0.5 on both rows
    assert shaped.flatten().tolist() == pytest.approx([1.2, 1.5, -0.8, -0.5])
    assert shaped.sum().item() == pytest.approx(1.4)


@pytest.mark.parametrize(
    "kw,field",
    [({"alpha": -0.1}, "alpha"), ({"alpha": NAN}, "alpha"), ({"alpha": INF}, "alpha"), ({"kappa": 0.5}, "kappa"),
     ({"kappa": INF}, "kappa"), ({"kappa": True}, "kappa")],
)  # fmt: skip
def test_entropy_advantage_bad_settings_name_their_field(kw, field):
    x = make_batch(0)
    with pytest.raises(ValueError, match=f"^{field}="):
        entropy_advantage(x["adv"], x["ent"], x["mask"], **kw)
    with pytest.raises(ValueError, match="shape"):
        entropy_advantage(x["adv"], x["ent"][:, :3], x["mask"])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "name,kw,field",
    [
        ("sapo", {"tau_pos": 0.0}, "tau_pos"), ("sapo", {"tau_neg": -1.0}, "tau_neg"),
        ("sapo", {"tau_pos": NAN}, "tau_pos"), ("sapo", {"tau_neg": INF}, "tau_neg"),
        ("dppo", {"divergence": "js"}, "divergence"), ("dppo", {"delta_low": -0.1}, "delta_low"),
        ("dppo", {"delta_high": NAN}, "delta_high"), ("dppo", {"delta_high": INF}, "delta_high"),
        ("dppo", {"tis_cap": 0.0}, "tis_cap"), ("dppo", {"tis_cap": NAN}, "tis_cap"),
        ("ce_gppo", {"beta_low": -0.5}, "beta_low"), ("ce_gppo", {"beta_high": INF}, "beta_high"),
        ("ce_gppo", {"beta_high": NAN}, "beta_high"), ("ce_gppo", {"dual_clip": 1.0}, "dual_clip"),
        ("ce_gppo", {"clip_low": -0.1}, "clip_low"),
    ],
)  # fmt: skip
def test_bad_settings_are_a_value_error_naming_the_field(name, kw, field):
    x = make_batch(0)
    with pytest.raises(ValueError, match=field):
        FUNCTIONS[name](x["lp"], x["old"], x["adv"], x["mask"], **kw)


def test_the_registry_and_the_config_hold_the_new_objectives_and_flags():
    assert {"sapo", "dppo", "ce_gppo"} <= set(OBJECTIVES)
    flags = set(build_parser()._option_string_actions)
    for flag in (
        "--loss.sapo.tau_pos", "--loss.sapo.tau_neg", "--loss.dppo.divergence", "--loss.dppo.delta_low",
        "--loss.dppo.delta_high", "--loss.dppo.tis_cap", "--loss.ce_gppo.beta_low", "--loss.ce_gppo.beta_high",
        "--algo.entropy_adv_alpha", "--algo.entropy_adv_kappa",
    ):  # fmt: skip
        assert flag in flags, flag
    cfg = from_args(["--loss.type", "dppo", "--loss.dppo.divergence", "kl", "--algo.entropy_adv_alpha", "0.4"])
    validate(cfg)
    assert cfg.algo.entropy_adv() == (0.4, 2.0) and from_args([]).algo.entropy_adv() is None
    # the pipelines carry the sources' settings
    assert PIPELINES["ce_gppo"] == {
        "loss.type": "ce_gppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2, "loss.dual_clip": 10.0
    }  # fmt: skip
    assert PIPELINES["sapo"] == {"loss.type": "sapo"} and PIPELINES["dppo"] == {"loss.type": "dppo"}
    ce = from_args([], PIPELINES["ce_gppo"])
    assert (ce.loss.ce_gppo.beta_low, ce.loss.ce_gppo.beta_high) == (0.75, 1.0)
    assert validate(ce) == []  # its dual clip is its own: no note that it is ignored


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--loss.sapo.tau_pos", "0"], "--loss.sapo.tau_pos: 0.0 must be"),
        (["--loss.sapo.tau_neg", "nan"], "--loss.sapo.tau_neg: nan must be"),
        (["--loss.dppo.divergence", "js"], "--loss.dppo.divergence: 'js': tv | kl"),
        (["--loss.dppo.delta_low", "-0.1"], "--loss.dppo.delta_low: -0.1 must be"),
        (["--loss.dppo.delta_high", "inf"], "--loss.dppo.delta_high: inf must be"),
        (["--loss.dppo.tis_cap", "-1"], "--loss.dppo.tis_cap: -1.0 must be"),
        (["--loss.ce_gppo.beta_low", "-1"], "--loss.ce_gppo.beta_low: -1.0 must be"),
        (["--loss.type", "ce_gppo", "--loss.dual_clip", "0.5"], "--loss.dual_clip: must be 0"),
        (["--algo.entropy_adv_alpha", "-0.1"], "--algo.entropy_adv_alpha: -0.1 must be"),
        (["--algo.entropy_adv_kappa", "0.5"], "--algo.entropy_adv_kappa: 0.5 must be"),
    ],
)
def test_bad_settings_are_refused_at_config_time_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        validate(from_args(flags))


# ---------------------------------------------------------------- through the registry


def registered(name: str, **fields):
    obj = get_objective(name)
    return obj, obj.config(**fields)


def test_the_registered_objectives_pass_their_settings_to_the_plain_functions():
    x = make_batch(7, B=8, L=10, spread=0.6, per_token_adv=True)
    ctx = LossContext(clip_low=0.1, clip_high=0.28, dual_clip=2.0, agg="seq_mean_token_sum", tokens=300.0,
                      sequences=45.0, dp_size=2)  # fmt: skip
    cases = [
        ("sapo", {"tau_pos": 0.7, "tau_neg": 1.4},
         dict(tau_pos=0.7, tau_neg=1.4, agg="seq_mean_token_mean", normalizer=45.0)),  # always per response
        ("dppo", {"divergence": "kl", "delta_low": 0.02, "delta_high": 0.08, "tis_cap": 3.0},
         dict(divergence="kl", delta_low=0.02, delta_high=0.08, tis_cap=3.0, agg="seq_mean_token_sum",
              normalizer=45.0)),
        ("dppo", {}, dict(delta_low=None, delta_high=None, tis_cap=20.0, agg="seq_mean_token_sum", normalizer=45.0)),
        ("dppo", {"tis_cap": 0.0}, dict(tis_cap=None, agg="seq_mean_token_sum", normalizer=45.0)),
        ("ce_gppo", {"beta_low": 0.3, "beta_high": 1.7},
         dict(clip_low=0.1, clip_high=0.28, beta_low=0.3, beta_high=1.7, dual_clip=2.0, agg="seq_mean_token_sum",
              normalizer=45.0)),
    ]  # fmt: skip
    for name, fields, plain in cases:
        obj, params = registered(name, **fields)
        want, want_grad = run_loss(name, x, dp_size=2, **plain)
        lp = x["lp"].clone().requires_grad_(True)
        out, _ = run_objective(name, params, None, ctx, lp, x["old"], x["adv"], x["mask"], is_weights=x["w"])
        out.loss.backward()
        assert out.loss.item() == want.loss.item(), (name, fields)
        assert torch.equal(lp.grad, want_grad) and torch.equal(out.selected, want.selected)
        assert out.metrics == want.metrics


@pytest.mark.parametrize("name", [*NAMES, "ppo", "clip_cov", "kl_cov", "high_entropy", "cispo", "gspo"])
def test_the_entropy_advantage_shapes_what_the_selection_and_the_loss_see(name):
    """With `ctx.entropy_adv` a loss call equals the same call on advantages shaped beforehand with its entropy
    (Clip-Cov and KL-Cov: their covariance and selection too), and logs the shaping's metrics."""
    x = make_batch(9, B=8, L=12, spread=0.3)
    obj = get_objective(name)
    params = obj.config(**({"ratio": 0.2} if name in ("clip_cov", "kl_cov") else {}))
    if name == "clip_cov":
        params = dataclasses.replace(params, lb=-1e9, ub=1e9)
    shaped = entropy_advantage(x["adv"], x["ent"], x["mask"], alpha=0.4, kappa=2.0)

    def call(advantages, entropy_adv):
        lp = x["lp"].clone().requires_grad_(True)
        ctx = LossContext(generator=torch.Generator().manual_seed(0), entropy_adv=entropy_adv)
        out, _ = run_objective(name, params, None, ctx, lp, x["old"], advantages, x["mask"], entropy=x["ent"],
                               is_weights=x["w"])  # fmt: skip
        out.loss.backward()
        return out, lp.grad

    got, got_grad = call(x["adv"], (0.4, 2.0))
    want, want_grad = call(shaped, None)
    plain, _ = call(x["adv"], None)
    assert got.loss.item() == want.loss.item() and torch.equal(got_grad, want_grad)
    assert torch.equal(got.selected, want.selected)
    extra = entropy_advantage_metrics(x["adv"], x["ent"], x["mask"], alpha=0.4, kappa=2.0)
    assert got.metrics == {**want.metrics, **extra} and extra["entropy_adv_shift"] > 0
    assert got.loss.item() != plain.loss.item()
    if name in ("clip_cov", "kl_cov"):  # the covariance is computed on the shaped advantage
        assert got.metrics["cov_mean"] != pytest.approx(plain.metrics["cov_mean"])
    with pytest.raises(ValueError, match="entropy"):
        run_objective(name, params, None, LossContext(entropy_adv=(0.4, 2.0)), x["lp"], x["old"], x["adv"],
                      x["mask"])  # fmt: skip


# ---------------------------------------------------------------- in the policy actor's step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def actor_step(tiny: str, loss: str, *flags: str, record: list | None = None, monkeypatch=None):
    """One train_step of one policy rank (tests/unit/policy_harness.py's stand-in for DeepSpeed) on
    tests/integration/test_policy.py's batch: (metrics, weights after it). `record` collects every loss call's
    (context, advantages, entropy, mask)."""
    from entropy_openrlhf.actors import train_phases
    from entropy_openrlhf.actors.chunked_head import use_chunked_head
    from entropy_openrlhf.actors.forward import use_shared_prefix
    from tests.integration.test_policy import fixed_batch
    from tests.unit.policy_harness import load_model, make_actor, one_thread, shard, weights

    cfg = from_args(
        ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3", "--offpolicy.preset", "none",
         *flags],
        {"loss.type": loss},
    )  # fmt: skip
    validate(cfg)
    if record is not None:
        original = train_phases.run_objective

        def recording(name, params, loss_cfg, ctx, lp, old, adv, mask, **kw):
            record.append((ctx, adv.clone(), kw.get("entropy"), mask.clone()))
            return original(name, params, loss_cfg, ctx, lp, old, adv, mask, **kw)

        monkeypatch.setattr(train_phases, "run_objective", recording)
    with one_thread():
        model = load_model(tiny)
        # what build_policy_engine does to the model before DeepSpeed wraps it (its packing and output head)
        use_shared_prefix(model, cfg.train.shared_prefix)
        use_chunked_head(model, cfg.train.head_chunk_tokens)
        model.config.use_cache = False
        actor = make_actor(cfg, model, 0, 1)
        samples, sizes = shard(cfg, fixed_batch(seed=0), 1)[0]
        metrics = actor.train_step(samples, 0, micro_sizes=sizes)
    return metrics, weights(model)


def test_the_actor_shapes_every_loss_calls_advantages_with_the_training_forwards_entropy(tiny, monkeypatch):
    from tests.integration.test_policy import max_diff

    calls: list = []
    flags = ["--algo.entropy_adv_alpha", "0.4", "--algo.entropy_adv_kappa", "2"]
    plain_metrics, plain = actor_step(tiny, "sapo")
    shaped_metrics, shaped = actor_step(tiny, "sapo", *flags, record=calls, monkeypatch=monkeypatch)
    assert calls and all(ctx.entropy_adv == (0.4, 2.0) for ctx, *_ in calls)
    for _, _, entropy, mask in calls:  # the current policy's entropy, detached, on the loss call's grid
        assert entropy is not None and entropy.shape == mask.shape and not entropy.requires_grad
        assert (entropy[mask.bool()] > 0).all()
    assert shaped_metrics["loss/entropy_adv_shift"] > 0
    assert 0 <= shaped_metrics["loss/entropy_adv_capped_frac"] <= 1
    assert "loss/entropy_adv_shift" not in plain_metrics
    assert max_diff(plain, shaped) > 1e-6  # the shaping changes the update


def test_the_global_selection_sees_the_shaped_advantages(tiny, monkeypatch):
    """--loss.scope global: KL-Cov's covariance is centred on the mean of the shaped advantages over the whole
    mini-batch, the same values its loss calls see."""
    calls: list = []
    flags = ["--loss.scope", "global", "--loss.kl_cov.ratio", "0.1", "--algo.entropy_adv_alpha", "0.4"]
    metrics, _ = actor_step(tiny, "kl_cov", *flags, record=calls, monkeypatch=monkeypatch)
    by_mini: dict = {}
    for ctx, adv, entropy, mask in calls:
        shaped = entropy_advantage(adv, entropy, mask, alpha=0.4, kappa=2.0)
        by_mini.setdefault(ctx.cov_means, []).append(shaped[mask.bool()])
    assert len(by_mini) == from_args(["--preset", "smoke"]).train.mini_batches
    for means, parts in by_mini.items():
        assert means[0] == pytest.approx(float(torch.cat(parts).mean()), rel=1e-5, abs=1e-6)
    assert metrics["loss/kl_cov_frac"] > 0 and metrics["loss/entropy_adv_shift"] > 0


def test_the_openrlhf_route_takes_the_new_objectives_and_their_settings():
    from entropy_openrlhf.integrations.openrlhf import build_settings

    params, _ = build_settings("dppo", {"divergence": "kl", "tis_cap": 0.0})
    assert (params.divergence, params.tis_cap) == ("kl", 0.0)
    assert build_settings("sapo", {"tau_neg": 2.0})[0].tau_neg == 2.0
    assert build_settings("ce_gppo", {"beta_low": 0.5})[0].beta_low == 0.5
    with pytest.raises(ValueError, match="--objective.beta_high: -1"):
        build_settings("ce_gppo", {"beta_high": -1.0})
    with pytest.raises(ValueError, match="--objective.divergence: 'js'"):
        build_settings("dppo", {"divergence": "js"})
