"""GSPO (arXiv 2507.18071): one importance ratio per sequence (the geometric mean of its tokens' ratios), clipped
per sequence, averaged per sequence then over sequences
whatever --loss.agg says (the paper's aggregation)."""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.algorithms.losses import LossOutput, gspo_loss
from entropy_openrlhf.algorithms.objectives.base import LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


@dataclass
class GSPOConfig:
    clip_low: float = option(3e-4, "the sequence ratio's clip below 1 (the paper, section 5.1: 3e-4)")
    clip_high: float = option(4e-4, "the sequence ratio's clip above 1 (the paper: 4e-4)")


def validate(params: GSPOConfig, cfg) -> list[str]:
    if params.clip_low < 0 or params.clip_high < 0:
        return ["--loss.gspo.clip_low: the clip widths --loss.gspo.clip_low/clip_high must be >= 0"]
    return []


@register_objective(
    "gspo", GSPOConfig, validate=validate,
    summary="GSPO: a sequence-level importance ratio, clipped per sequence",
)  # fmt: skip
def gspo(batch: TokenBatch, params: GSPOConfig, ctx: LossContext) -> LossOutput:
    return gspo_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, clip_low=params.clip_low,
        clip_high=params.clip_high, normalizer=ctx.sequences, dp_size=ctx.dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
