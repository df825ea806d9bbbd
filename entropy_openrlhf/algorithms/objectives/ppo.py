"""PPO's clipped surrogate (GRPO's loss). With --loss.clip_high above --loss.clip_low it is DAPO's clip-higher
(pipelines/clip_higher.py); --loss.dual_clip bounds the loss of negative-advantage tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import (
    AggMode,
    LossOutput,
    aggregate,
    clip_fracs,
    cov_metrics,
    masked_mean,
    ppo_terms,
    prepare,
    token_covariance,
    weighted,
)
from entropy_openrlhf.algorithms.objectives.base import LossContext, TokenBatch, register_objective


def ppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped PPO surrogate; clip_high > clip_low is DAPO's clip-higher; `dual_clip` (> 1) bounds A<0 tokens."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1")
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    ratio, unclipped, clipped = ppo_terms(adv, log_ratio, clip_low, clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * dual_clip), token_loss)
    token_loss = weighted(token_loss, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    selected = torch.zeros_like(valid)
    metrics = {
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        **clip_fracs(adv, ratio.detach(), valid, clip_low, clip_high),
        **cov_metrics(token_covariance(lp, adv, valid), valid, selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class PPOConfig:
    """PPO has no settings of its own: its clip widths are the shared --loss.clip_low/high and --loss.dual_clip."""


@register_objective("ppo", PPOConfig, summary="PPO's clipped surrogate (GRPO; clip-higher with clip_high > clip_low)")
def ppo(batch: TokenBatch, params: PPOConfig, ctx: LossContext) -> LossOutput:
    return ppo_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, clip_low=ctx.clip_low,
        clip_high=ctx.clip_high, dual_clip=ctx.dual_clip, agg=ctx.agg, normalizer=ctx.normalizer,
        dp_size=ctx.dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
