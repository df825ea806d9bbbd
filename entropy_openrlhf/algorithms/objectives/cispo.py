"""CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, detached importance ratio, so every
token keeps its gradient; the clip bounds the weight instead of dropping the token."""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.algorithms.losses import LossOutput, cispo_loss
from entropy_openrlhf.algorithms.objectives.base import LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


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
