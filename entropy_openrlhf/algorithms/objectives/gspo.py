"""GSPO (arXiv 2507.18071): one importance ratio per sequence (the geometric mean of its tokens' ratios), clipped
per sequence, averaged per sequence then over sequences
whatever --loss.agg says (the paper's aggregation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import (
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


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO: PPO's clipped surrogate with one ratio per sequence, s_i = exp(mean_t d_t) (docs/algorithms/losses.md,
    'GSPO').

    d_t is clamped per token before the mean. In token form each token carries sg(s_i) * exp(lp_t - sg(lp_t)):
    value s_i, gradient s_i through the raw lp_t. Always seq-mean-token-mean; `normalizer` = the non-empty
    sequences of the whole mini-batch on all ranks (then the loss is multiplied by `dp_size`).
    """
    check_clip_widths(clip_low, clip_high)
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    m = valid.float()
    n_tok = m.sum(-1)
    nonempty = n_tok > 0
    # padding is 0 in log_ratio already (both inputs were zeroed); the clamp to +-20 per token bounds the mean too
    log_seq = ((log_ratio * m).sum(-1) / n_tok.clamp(min=1.0)).detach()
    seq_ratio = log_seq.exp().unsqueeze(-1) * (lp - lp.detach()).exp()
    unclipped = -adv * seq_ratio
    clipped = -adv * seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = weighted(torch.maximum(unclipped, clipped), is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    # a sequence counts as clipped when the clip removes the gradient of its tokens (all of them when A is constant
    # over the sequence, as with GRPO)
    seq_clipped = (valid & (clipped > unclipped).detach()).any(-1)
    n_seq = int(nonempty.sum())
    metrics = {
        "gspo_clip_frac": float(seq_clipped.sum()) / max(n_seq, 1),
        "seq_log_ratio_mean": float(log_seq[nonempty].mean()) if n_seq else 0.0,
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        **cov_metrics(token_covariance(lp, adv, valid), valid, valid),
    }
    loss = aggregate(token_loss, valid, "seq_mean_token_mean", normalizer, dp_size)
    return LossOutput(loss, token_loss, valid.clone(), metrics)


# --------------------------------------------------------------------------- the objective, registered


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
