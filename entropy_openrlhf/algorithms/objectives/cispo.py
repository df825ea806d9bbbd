"""CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, detached importance ratio, so every
token keeps its gradient; the clip bounds the weight instead of dropping the token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import (
    AggMode,
    LossOutput,
    aggregate,
    check_clip_widths,
    cov_metrics,
    masked_mean,
    prepare,
    token_covariance,
    weighted,
)
from entropy_openrlhf.algorithms.objectives.base import LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 10.0,
    clip_high: float = 0.2,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """CISPO: -sg(clip(rho, 1 - clip_low, 1 + clip_high)) * A * logp on every valid token (docs/algorithms/losses.md,
    'CISPO').

    The clipped ratio is a constant weight, so the clip bounds a token's gradient instead of removing it. The loss
    value holds logp itself: it is not 0 on-policy and not comparable with PPO's. clip_low >= 1 leaves the weight
    unbounded below (the default 10 does, as the paper).
    """
    check_clip_widths(clip_low, clip_high)
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.exp().detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = weighted(-weight * adv * lp, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    clipped = valid & ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high))
    metrics = {
        "cispo_clip_frac": float(clipped.sum()) / max(int(valid.sum()), 1),
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        **cov_metrics(token_covariance(lp, adv, valid), valid, valid),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, valid.clone(), metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class CISPOConfig:
    clip_low: float = option(
        10.0, "the weight's lower bound is 1 - clip_low; any value >= 1 leaves it unbounded below, as the paper does"
    )
    clip_high: float = option(0.2, "the weight's upper bound is 1 + clip_high (verl's CISPO example: 0.2)")


def validate(params: CISPOConfig, cfg) -> list[str]:
    if params.clip_low < 0 or params.clip_high < 0:
        return ["--loss.cispo.clip_low: the clip widths --loss.cispo.clip_low/clip_high must be >= 0"]
    return []


@register_objective(
    "cispo", CISPOConfig, validate=validate, summary="CISPO: clipped, detached importance weight on every token"
)
def cispo(batch: TokenBatch, params: CISPOConfig, ctx: LossContext) -> LossOutput:
    return cispo_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, clip_low=params.clip_low,
        clip_high=params.clip_high, agg=ctx.agg, normalizer=ctx.normalizer, dp_size=ctx.dp_size,
        is_weights=batch.is_weights,
    )  # fmt: skip
