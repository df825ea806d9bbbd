"""Clip-Cov (arXiv 2505.22617): PPO with the gradient of a few random high-covariance tokens stopped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.losses import LossOutput, clip_cov_loss, clip_cov_select
from entropy_openrlhf.algorithms.objectives.base import Knob, LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


@dataclass
class ClipCovConfig:
    ratio: float = option(2e-4, "fraction of valid tokens whose gradient is stopped (paper: 2e-4)")
    lb: float = option(1.0, "lower covariance bound of the candidates (paper: 1)")
    ub: float = option(5.0, "upper covariance bound of the candidates (paper: 5)")
    within: str = option(
        "", "choose only among the tokens another selector picks: '' (all) | high_entropy (the top "
        "--loss.high_entropy.top_frac by entropy); the quota still counts every valid token",
    )  # fmt: skip


def select(batch: TokenBatch, params: ClipCovConfig, ctx: LossContext, candidates: torch.Tensor | None):
    return clip_cov_select(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, ratio=params.ratio, cov_lb=params.lb,
        cov_ub=params.ub, clip_low=ctx.clip_low, clip_high=ctx.clip_high, generator=ctx.generator,
        cov_means=ctx.cov_means, candidates=candidates,
    )  # fmt: skip


def validate(params: ClipCovConfig, cfg) -> list[str]:
    errors = []
    if not 0 < params.ratio <= 1:
        errors.append(f"--loss.clip_cov.ratio: {params.ratio} must be a fraction in (0, 1]; 2e-4 = 0.02 % of tokens")
    if not params.lb < params.ub:
        errors.append("--loss.clip_cov.lb: must be below --loss.clip_cov.ub")
    return errors


def notes(params: ClipCovConfig, cfg) -> list[str]:
    if (cfg.loss.clip_low, cfg.loss.clip_high) != (1.0, 1.0):
        return ["the paper's Clip-Cov widens the PPO clip to 1 (--loss.clip_low 1 --loss.clip_high 1)"]
    return []


@register_objective(
    "clip_cov", ClipCovConfig, select=select, knobs=(Knob("ratio", cap=1.0),), validate=validate, notes=notes,
    summary="Clip-Cov: PPO with the gradient of random high-covariance tokens stopped",
)  # fmt: skip
def clip_cov(batch: TokenBatch, params: ClipCovConfig, ctx: LossContext) -> LossOutput:
    return clip_cov_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, ratio=params.ratio, cov_lb=params.lb,
        cov_ub=params.ub, clip_low=ctx.clip_low, clip_high=ctx.clip_high, generator=ctx.generator,
        selected=ctx.selected, cov_means=ctx.cov_means, agg=ctx.agg, normalizer=ctx.normalizer, dp_size=ctx.dp_size,
        is_weights=batch.is_weights,
    )  # fmt: skip
