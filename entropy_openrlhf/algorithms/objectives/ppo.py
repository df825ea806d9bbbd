"""PPO's clipped surrogate (GRPO's loss). With --loss.clip_high above --loss.clip_low it is DAPO's clip-higher
(pipelines/clip_higher.py); --loss.dual_clip bounds the loss of negative-advantage tokens."""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.algorithms.losses import LossOutput, ppo_loss
from entropy_openrlhf.algorithms.objectives.base import LossContext, TokenBatch, register_objective


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
