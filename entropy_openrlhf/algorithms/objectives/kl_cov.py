"""KL-Cov (arXiv 2505.22617): unclipped policy gradient plus coef * |logp - old_logp| on the top-covariance
tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.losses import LossOutput, kl_cov_loss, kl_cov_select
from entropy_openrlhf.algorithms.objectives.base import Knob, LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


@dataclass
class KLCovConfig:
    ratio: float = option(
        2e-3, "fraction of valid tokens with the KL penalty: 2e-3 for 7B, 2e-4 for 32B (a fraction, not %)"
    )
    coef: float = option(1.0, "beta, the penalty coefficient on |logp - old_logp| (paper: 1)")
    within: str = option(
        "", "choose only among the tokens another selector picks: '' (all) | high_entropy (the top "
        "--loss.high_entropy.top_frac by entropy); the quota still counts every valid token",
    )  # fmt: skip


def select(batch: TokenBatch, params: KLCovConfig, ctx: LossContext, candidates: torch.Tensor | None):
    return kl_cov_select(
        batch.log_probs, batch.advantages, batch.mask, ratio=params.ratio, cov_means=ctx.cov_means,
        candidates=candidates,
    )  # fmt: skip


def validate(params: KLCovConfig, cfg) -> list[str]:
    errors = []
    if not 0 < params.ratio <= 1:
        errors.append(f"--loss.kl_cov.ratio: {params.ratio} must be a fraction in (0, 1]; 2e-3 means 0.2 % of tokens")
    if params.coef < 0:
        errors.append("--loss.kl_cov.coef: must be >= 0")
    return errors


def notes(params: KLCovConfig, cfg) -> list[str]:
    if cfg.train.mini_batches == 1:
        return [
            "KL-Cov with one optimizer step per rollout batch acts as plain policy gradient: on-policy, "
            "|logp - old_logp| = 0, so the penalty has no gradient. Use --train.mini_batches > 1 (the paper: 8)."
        ]
    return []


@register_objective(
    "kl_cov", KLCovConfig, select=select, knobs=(Knob("coef"), Knob("ratio", cap=1.0)), validate=validate,
    notes=notes, summary="KL-Cov: policy gradient plus an L1 pull to the old policy on top-covariance tokens",
)  # fmt: skip
def kl_cov(batch: TokenBatch, params: KLCovConfig, ctx: LossContext) -> LossOutput:
    return kl_cov_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, ratio=params.ratio, coef=params.coef,
        selected=ctx.selected, cov_means=ctx.cov_means, agg=ctx.agg, normalizer=ctx.normalizer,
        dp_size=ctx.dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
