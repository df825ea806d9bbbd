"""The 80/20 "forking tokens" method (Wang et al. 2025, arXiv 2506.01939): PPO's clipped surrogate on the
top-entropy fraction of tokens only, averaged over those tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.losses import LossOutput, high_entropy_loss, high_entropy_select
from entropy_openrlhf.algorithms.objectives.base import Knob, LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


@dataclass
class HighEntropyConfig:
    top_frac: float = option(0.2, "fraction of valid tokens, those of highest entropy, given a gradient (paper: 0.2)")


def select(batch: TokenBatch, params: HighEntropyConfig, ctx: LossContext, candidates: torch.Tensor | None):
    if batch.entropy is None:
        raise ValueError("high_entropy selects by token entropy, and this batch carries none")
    chosen = high_entropy_select(batch.entropy, batch.mask, top_frac=params.top_frac)
    return chosen if candidates is None else chosen & candidates.bool()


def validate(params: HighEntropyConfig, cfg) -> list[str]:
    if not 0 <= params.top_frac <= 1:
        return [f"--loss.high_entropy.top_frac: {params.top_frac} must be in [0, 1]"]
    return []


@register_objective(
    "high_entropy", HighEntropyConfig, select=select, needs_entropy=True,
    knobs=(Knob("top_frac", direction=-1, cap=1.0),), validate=validate,
    summary="80/20: PPO on the top-entropy (forking) tokens only",
)  # fmt: skip
def high_entropy(batch: TokenBatch, params: HighEntropyConfig, ctx: LossContext) -> LossOutput:
    if ctx.selected_total is not None:
        # selected over the whole mini-batch on all ranks: its mean over every selected token there
        normalizer, dp_size = ctx.selected_total, ctx.dp_size
    else:
        # selected per micro-batch, as the authors do: each micro-batch's mean over its own selected tokens, averaged
        # over the mini-batch's micro-batches (and over ranks by the data-parallel gradient average)
        n_selected = int(ctx.selected.sum()) if ctx.selected is not None else None
        normalizer = None if n_selected is None else max(n_selected, 1) * ctx.micro_batches
        dp_size = 1
    return high_entropy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, batch.entropy, top_frac=params.top_frac,
        clip_low=ctx.clip_low, clip_high=ctx.clip_high, selected=ctx.selected, normalizer=normalizer,
        dp_size=dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
