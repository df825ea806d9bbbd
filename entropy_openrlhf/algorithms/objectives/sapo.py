"""SAPO (Qwen, soft adaptive policy optimisation): PPO's hard clip replaced by a sigmoid gate on the ratio, whose
gradient fades smoothly as the ratio leaves 1 instead of being cut to 0, faster for negative advantages."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import (
    AggMode,
    LossOutput,
    aggregate,
    cov_metrics,
    masked_mean,
    prepare,
    token_covariance,
    weighted,
)
from entropy_openrlhf.algorithms.objectives.base import LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


def check_temperatures(tau_pos: float, tau_neg: float) -> None:
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"{name}={tau!r} must be a finite number > 0 (the gate's temperature)")


def sapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg: AggMode = "seq_mean_token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """SAPO: -(4 / tau) * sigmoid(tau * (rho - 1)) * A per valid token, tau = tau_pos where A > 0 and tau_neg
    otherwise (docs/algorithms/losses.md, 'SAPO').

    Its gradient is -A * 4 s (1 - s) * rho with s the gate: the plain policy gradient -A at rho = 1, fading smoothly
    (never cut to 0) as rho moves away. The value at rho = 1 is -2A / tau, not 0: not comparable with PPO's.
    Every valid token counts as selected.
    """
    check_temperatures(tau_pos, tau_neg)
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.exp()
    # A = 0 takes tau_neg, as verl's `where(A > 0, pos, neg)`: its loss is 0 either way
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    token_loss = weighted(-(4.0 / tau) * gate * adv, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    g = gate.detach()
    metrics = {
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        # 4 s (1 - s): the gradient's attenuation relative to the plain policy gradient (1 = none, at rho = 1)
        "sapo_gate_mean": masked_mean(4.0 * g * (1.0 - g), valid),
        **cov_metrics(token_covariance(lp, adv, valid), valid, valid),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, valid.clone(), metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class SAPOConfig:
    tau_pos: float = option(1.0, "the gate's temperature on tokens with A > 0 (verl, TRL, SkyRL: 1.0)")
    tau_neg: float = option(
        1.05, "the gate's temperature on tokens with A <= 0; larger fades their gradient faster (verl, TRL: 1.05)"
    )


def validate(params: SAPOConfig, cfg) -> list[str]:
    errors = []
    for flag, tau in (("--loss.sapo.tau_pos", params.tau_pos), ("--loss.sapo.tau_neg", params.tau_neg)):
        if not (math.isfinite(tau) and tau > 0):
            errors.append(f"{flag}: {tau} must be a finite number > 0")
    return errors


@register_objective(
    "sapo", SAPOConfig, validate=validate,
    summary="SAPO: a soft sigmoid gate on the ratio in place of PPO's hard clip",
)  # fmt: skip
def sapo(batch: TokenBatch, params: SAPOConfig, ctx: LossContext) -> LossOutput:
    # always a mean per response, then over responses, whatever --loss.agg says: verl's SAPO ignores its
    # loss_agg_mode and does this (as for GSPO)
    return sapo_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, tau_pos=params.tau_pos,
        tau_neg=params.tau_neg, agg="seq_mean_token_mean", normalizer=ctx.sequences, dp_size=ctx.dp_size,
        is_weights=batch.is_weights,
    )  # fmt: skip
