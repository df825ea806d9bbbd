"""Every registered objective, run as the trainer runs it (the registry's selector, then its loss, with a
LossContext), against its plain function in losses.py called directly with the settings it should receive.

The plain functions are checked against reference formulas in test_losses.py and test_objective_losses.py; what
these tests add is the wiring in between: which config field or context value reaches which argument. So every
setting is asymmetric (clip_low != clip_high, tokens != sequences, dp_size 2, IS weights that are not 1), and each
case first checks that the plain function's result would change under the plausible miswirings (swapped clip
widths, the other normaliser, a setting dropped), so a wrapper that made one of them could not pass unseen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from entropy_openrlhf.algorithms import losses
from entropy_openrlhf.algorithms.objectives import OBJECTIVES, LossContext, TokenBatch, get_objective, select_tokens

LENGTHS = [10, 3, 7, 1, 9, 5, 8, 6]  # valid tokens per row: 49 tokens in 8 sequences
WIDTH = 10
# as if this call were one of 3 micro-batches on each of 2 ranks: mini-batch counts unlike this call's own
TOKENS, SEQUENCES = 300.0, 45.0
SEED = 7

# the objectives' own settings, each unlike its default and, for clip widths, unlike its partner
PARAMS: dict[str, dict[str, Any]] = {
    "ppo": {},
    "clip_cov": {"ratio": 0.2, "lb": 0.5, "ub": 2.0},
    "kl_cov": {"ratio": 0.15, "coef": 0.7},
    "high_entropy": {"top_frac": 0.3},
    "cispo": {"clip_low": 0.3, "clip_high": 0.1},
    "gspo": {"clip_low": 0.02, "clip_high": 0.08},
    "sapo": {"tau_pos": 0.8, "tau_neg": 1.6},
    "dppo": {"delta_low": 0.05, "delta_high": 0.1, "tis_cap": 1.5},
    "ce_gppo": {"beta_low": 0.3, "beta_high": 0.8},
    # the non-default forms of an objective, each its own case: Clip-Cov's bounds in standard deviations (the
    # clip-cov-small preset) and KL-Cov's penalty on PPO's clipped loss (the kl_cov_clip ablation)
    # (bounds under which this batch's two units select different tokens, which the test checks)
    "clip_cov/std": {"ratio": 0.2, "lb": 0.5, "ub": 2.0, "bounds_unit": "std"},
    "kl_cov/ppo_clip": {"ratio": 0.15, "coef": 0.7, "ppo_clip": True},
    # DPPO's binary-KL region, with its default thresholds (0 on the flag: the divergence's own)
    "dppo/kl": {"divergence": "kl", "tis_cap": 1.5},
}


def objective_of(case: str) -> str:
    """The registered objective a case runs: `clip_cov/std` runs `clip_cov`."""
    return case.split("/")[0]


def make_batch() -> TokenBatch:
    """A fresh batch (a new leaf for the gradient) with the same values on every call."""
    gen = torch.Generator().manual_seed(SEED)
    mask = (torch.arange(WIDTH)[None] < torch.tensor(LENGTHS)[:, None]).float()
    rows = len(LENGTHS)
    lp = -torch.rand(rows, WIDTH, generator=gen) * 3
    # old policy 0.6 nats away on average: ratios beyond both clip bounds, and some beyond the dual clip (1.5)
    old = lp + 0.6 * torch.randn(rows, WIDTH, generator=gen)
    adv = torch.randn(rows, 1, generator=gen).expand(rows, WIDTH) * mask  # one advantage per sequence (GRPO)
    entropy = torch.rand(rows, WIDTH, generator=gen) * 3
    is_weights = 0.5 + torch.rand(rows, WIDTH, generator=gen)
    return TokenBatch(lp.requires_grad_(), old, adv.contiguous(), mask, entropy=entropy, is_weights=is_weights)


def make_context(agg: str, wider: bool) -> LossContext:
    """The trainer's context. `wider`: the selection was made over the whole mini-batch (--loss.scope global)."""
    ctx = LossContext(
        clip_low=0.25, clip_high=0.1, dual_clip=1.5, agg=agg, tokens=TOKENS, sequences=SEQUENCES, dp_size=2,
        micro_batches=3, generator=torch.Generator().manual_seed(SEED),
    )  # fmt: skip
    if wider:
        pick = torch.Generator().manual_seed(SEED + 1)
        ctx.selected = (torch.rand(len(LENGTHS), WIDTH, generator=pick) < 0.3) & make_batch().mask.bool()
        ctx.selected_total, ctx.cov_means = 40.0, (0.15, -1.4)
    return ctx


Call = tuple[Callable[..., losses.LossOutput], dict[str, Any]]


def plain_call(case: str, batch: TokenBatch, ctx: LossContext, wider: bool) -> Call:
    """The plain function and the keyword arguments the objective of `case` should hand it, written out from the
    documented meaning of each setting (not from the wrappers' code)."""
    p, name = PARAMS[case], objective_of(case)
    by_agg = TOKENS if ctx.agg == "token_mean" else SEQUENCES
    shared = {"agg": ctx.agg, "normalizer": by_agg, "dp_size": 2, "is_weights": batch.is_weights}
    gen = torch.Generator().manual_seed(SEED)
    wider_kw = {"selected": ctx.selected, "cov_means": ctx.cov_means} if wider else {}
    if wider and name == "high_entropy":  # it logs covariances around its own means
        del wider_kw["cov_means"]
    if name == "ppo":
        return losses.ppo_loss, {"clip_low": 0.25, "clip_high": 0.1, "dual_clip": 1.5, **shared}
    if name == "clip_cov":
        return losses.clip_cov_loss, {
            "ratio": p["ratio"], "cov_lb": p["lb"], "cov_ub": p["ub"], "bounds_unit": p.get("bounds_unit", "abs"),
            "clip_low": 0.25, "clip_high": 0.1, "generator": gen, **wider_kw, **shared,
        }  # fmt: skip
    if name == "kl_cov":
        # the ablation clips with the shared PPO widths, (low, high) in that order
        ppo_clip = (0.25, 0.1) if p.get("ppo_clip") else None
        return losses.kl_cov_loss, {"ratio": p["ratio"], "coef": p["coef"], "ppo_clip": ppo_clip, **wider_kw, **shared}
    if name == "high_entropy":
        # the mean over the selected tokens: of the whole mini-batch on all ranks when selected there, else of this
        # micro-batch's own, averaged over the mini-batch's micro-batches (no further division across ranks)
        if wider:
            norm, dp = 40.0, 2
        else:
            n_selected = int(losses.high_entropy_select(batch.entropy, batch.mask, top_frac=p["top_frac"]).sum())
            norm, dp = n_selected * 3, 1
        return losses.high_entropy_loss, {
            "entropy": batch.entropy, "top_frac": p["top_frac"], "clip_low": 0.25, "clip_high": 0.1,
            "normalizer": norm, "dp_size": dp, "is_weights": batch.is_weights, **wider_kw,
        }  # fmt: skip
    if name == "cispo":  # its own clip widths, not the shared PPO ones
        return losses.cispo_loss, {"clip_low": p["clip_low"], "clip_high": p["clip_high"], **shared}
    if name == "gspo":  # always a mean over sequences, whatever --loss.agg says
        return losses.gspo_loss, {
            "clip_low": p["clip_low"], "clip_high": p["clip_high"], "normalizer": SEQUENCES, "dp_size": 2,
            "is_weights": batch.is_weights,
        }  # fmt: skip
    if name == "sapo":  # always a mean over sequences, whatever --loss.agg says, as GSPO
        return losses.sapo_loss, {
            "tau_pos": p["tau_pos"], "tau_neg": p["tau_neg"], "agg": "seq_mean_token_mean", "normalizer": SEQUENCES,
            "dp_size": 2, "is_weights": batch.is_weights,
        }  # fmt: skip
    if name == "dppo":  # its own thresholds (None where the flag is 0) and cap, the shared aggregation
        return losses.dppo_loss, {
            "divergence": p.get("divergence", "tv"), "delta_low": p.get("delta_low"),
            "delta_high": p.get("delta_high"), "tis_cap": p["tis_cap"], **shared,
        }  # fmt: skip
    if name == "ce_gppo":  # the shared PPO clip and dual clip, its own betas
        return losses.ce_gppo_loss, {
            "clip_low": 0.25, "clip_high": 0.1, "beta_low": p["beta_low"], "beta_high": p["beta_high"],
            "dual_clip": 1.5, **shared,
        }  # fmt: skip
    raise AssertionError(f"objective {name!r} is registered but has no plain-function case here: add one")


def miswirings(kwargs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Plausible wrong versions of these arguments: swapped clip widths, another normaliser, a setting dropped or
    changed."""
    out = []
    if "clip_low" in kwargs:
        out.append(("swapped clip widths", {"clip_low": kwargs["clip_high"], "clip_high": kwargs["clip_low"]}))
    for low, high in (("tau_pos", "tau_neg"), ("beta_low", "beta_high"), ("delta_low", "delta_high")):
        if kwargs.get(low) is not None and kwargs.get(high) is not None:
            out.append((f"swapped {low}/{high}", {low: kwargs[high], high: kwargs[low]}))
    if kwargs.get("divergence") is not None:
        out.append(("other divergence", {"divergence": "tv" if kwargs["divergence"] == "kl" else "kl"}))
    if kwargs.get("ppo_clip") is not None:
        low, high = kwargs["ppo_clip"]
        out.append(("swapped PPO clip widths", {"ppo_clip": (high, low)}))
    if "normalizer" in kwargs:
        for other in (TOKENS, SEQUENCES, None):
            if other != kwargs["normalizer"]:
                out.append((f"normalizer {other}", {"normalizer": other}))
    if "dp_size" in kwargs:
        out.append(("other dp_size", {"dp_size": 1 if kwargs["dp_size"] != 1 else 2}))
    for key in ("is_weights", "dual_clip", "cov_means", "ppo_clip", "tis_cap"):
        if kwargs.get(key) is not None:
            out.append((f"no {key}", {key: None}))
    # the selection's settings matter only where the call selects; a selection made over the mini-batch is given
    selects_here = kwargs.get("selected") is None
    for key in ("coef",) + (("ratio", "top_frac", "cov_lb", "cov_ub") if selects_here else ()):
        if key in kwargs:
            out.append((f"other {key}", {key: kwargs[key] * 0.5}))
    if "bounds_unit" in kwargs and selects_here:
        other_unit = "abs" if kwargs["bounds_unit"] == "std" else "std"
        out.append((f"bounds_unit {other_unit}", {"bounds_unit": other_unit}))
    if "agg" in kwargs:
        out.append(("other agg", {"agg": "token_mean" if kwargs["agg"] != "token_mean" else "seq_mean_token_mean"}))
    return out


def run(fn: Callable[..., losses.LossOutput], kwargs: dict[str, Any]) -> tuple[losses.LossOutput, torch.Tensor]:
    batch = make_batch()
    if "generator" in kwargs:  # a fresh draw each call: the same tokens as the registry's selector drew
        kwargs["generator"] = torch.Generator().manual_seed(SEED)
    out = fn(batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, **kwargs)
    out.loss.backward()
    return out, batch.log_probs.grad


def same(a: tuple[losses.LossOutput, torch.Tensor], b: tuple[losses.LossOutput, torch.Tensor]) -> bool:
    """Loss, token losses, gradient, selection and metrics all equal (to fp32 rounding)."""
    (out_a, grad_a), (out_b, grad_b) = a, b
    return (
        torch.allclose(out_a.loss, out_b.loss, rtol=1e-6, atol=0)
        and torch.allclose(out_a.token_loss, out_b.token_loss, rtol=1e-6, atol=1e-9)
        and torch.allclose(grad_a, grad_b, rtol=1e-6, atol=1e-9)
        and torch.equal(out_a.selected, out_b.selected)
        and out_a.metrics.keys() == out_b.metrics.keys()
        and all(out_a.metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-9) for k, v in out_b.metrics.items())
    )


def test_every_registered_objective_has_a_case():
    batch, ctx = make_batch(), make_context("token_mean", wider=False)
    for name in OBJECTIVES:
        plain_call(name, batch, ctx, wider=False)  # raises for an objective this file does not know
    assert {objective_of(case) for case in PARAMS} == set(OBJECTIVES)


@pytest.mark.parametrize("wider", [False, True], ids=["micro_batch_scope", "global_scope"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("case", sorted(PARAMS))
def test_the_registry_runs_the_plain_function_with_the_settings_it_was_given(case, agg, wider):
    name = objective_of(case)
    obj = get_objective(name)
    if wider and obj.select is None:
        pytest.skip(f"{name} selects no tokens")
    params = obj.config(**PARAMS[case])
    fn, kwargs = plain_call(case, make_batch(), make_context(agg, wider), wider)
    expected = run(fn, kwargs)

    # the inputs can tell the right wiring from each wrong one
    for what, change in miswirings(kwargs):
        wrong = run(fn, {**kwargs, **change})
        assert not same(wrong, expected), f"{case}: this batch cannot see {what}"
        if "bounds_unit" in change:  # its logged bound alone would differ; the tokens chosen must differ too
            assert not torch.equal(wrong[0].selected, expected[0].selected), f"{case}: same tokens under {what}"

    # as the trainer runs it: the selector (micro-batch scope) or the mini-batch's selection, then the loss
    batch, ctx = make_batch(), make_context(agg, wider)
    if not wider and obj.select is not None:
        ctx = dataclasses.replace(ctx, generator=torch.Generator().manual_seed(SEED))
        ctx.selected, _ = select_tokens(name, params, None, batch, ctx)
    out = obj.loss(batch, params, ctx)
    out.loss.backward()
    got = (out, batch.log_probs.grad)
    assert same(got, expected), (case, float(out.loss), float(expected[0].loss), out.metrics, expected[0].metrics)
