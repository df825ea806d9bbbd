"""CE-GPPO (Klear, gradient-preserving clipping with bounded coefficients): PPO's clipped surrogate, except that the
tokens the clip holds keep a gradient, bounded and scaled by beta, instead of none. Its knob is the balance of the
two sides: the high side (A > 0, probability raised past the clip) pushes entropy up, the low side (A < 0, lowered
past it) pulls it down."""

from __future__ import annotations

import math
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


def check_betas(beta_low: float, beta_high: float) -> None:
    for name, beta in (("beta_low", beta_low), ("beta_high", beta_high)):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"{name}={beta!r} must be a finite number >= 0 (1 = GPPO, 0 = PPO's gradient)")


def ce_gppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta_low: float = 0.75,
    beta_high: float = 1.0,
    dual_clip: float | None = None,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """CE-GPPO (docs/algorithms/losses.md, 'CE-GPPO'), per valid token, with u = exp(lp - sg(lp)) (value 1,
    derivative 1 through the raw lp):

    - low (A < 0, rho < 1 - clip_low): -beta_low * (1 - clip_low) * A * u, gradient -beta_low (1 - clip_low) A;
    - high (A > 0, rho > 1 + clip_high): -beta_high * (1 + clip_high) * A * u, gradient -beta_high (1 + clip_high) A;
    - otherwise PPO's unclipped -rho * A.
    `dual_clip` C > 1 then bounds an A < 0 token's loss at -A * C (no gradient where it binds). beta 1 is GPPO;
    beta 0 has PPO's gradient (not its value). `selected` = the tokens left in the low or high branch.
    """
    check_clip_widths(clip_low, clip_high)
    check_betas(beta_low, beta_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (None: off)")
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.exp()
    r = ratio.detach()
    low = valid & (adv < 0) & (r < 1.0 - clip_low)
    high = valid & (adv > 0) & (r > 1.0 + clip_high)
    unit = (lp - lp.detach()).exp()
    token_loss = torch.where(
        low,
        -beta_low * (1.0 - clip_low) * adv * unit,
        torch.where(high, -beta_high * (1.0 + clip_high) * adv * unit, -ratio * adv),
    )
    bound = torch.zeros_like(valid)
    if dual_clip is not None:
        # the bound replaces the loss (a constant: no gradient) only where it is below it
        bound = valid & (adv < 0) & (token_loss.detach() > -adv * dual_clip)
        token_loss = torch.where(bound, -adv * dual_clip, token_loss)
    token_loss = weighted(token_loss, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    selected = (low | high) & ~bound
    n = max(int(valid.sum()), 1)
    metrics = {
        # the tokens PPO's clip would hold, per side: their sum is the authors' pg_clipfrac
        "ce_gppo_clip_frac_low": float(low.sum()) / n,
        "ce_gppo_clip_frac_high": float(high.sum()) / n,
        "dual_clip_frac": float(bound.sum()) / n,
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        **cov_metrics(token_covariance(lp, adv, valid), valid, selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class CEGPPOConfig:
    """CE-GPPO's clip widths and dual clip are the shared --loss.clip_low/high and --loss.dual_clip."""

    beta_low: float = option(
        0.75, "the gradient's scale on clipped tokens with A < 0, whose gradient lowers entropy (the authors' 7B "
        "recipe: 0.75; 1.5B: 0.5; 1 = GPPO; 0 = PPO's gradient)",
    )  # fmt: skip
    beta_high: float = option(
        1.0, "the gradient's scale on clipped tokens with A > 0, whose gradient raises entropy (the authors: 1.0)"
    )


def validate(params: CEGPPOConfig, cfg) -> list[str]:
    errors = []
    for flag, beta in (("--loss.ce_gppo.beta_low", params.beta_low), ("--loss.ce_gppo.beta_high", params.beta_high)):
        if not (math.isfinite(beta) and beta >= 0):
            errors.append(f"{flag}: {beta} must be a finite number >= 0")
    return errors


@register_objective(
    "ce_gppo", CEGPPOConfig, validate=validate,
    summary="CE-GPPO: PPO whose clipped tokens keep a bounded gradient, scaled per side by beta",
)  # fmt: skip
def ce_gppo(batch: TokenBatch, params: CEGPPOConfig, ctx: LossContext) -> LossOutput:
    return ce_gppo_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, clip_low=ctx.clip_low,
        clip_high=ctx.clip_high, beta_low=params.beta_low, beta_high=params.beta_high, dual_clip=ctx.dual_clip,
        agg=ctx.agg, normalizer=ctx.normalizer, dp_size=ctx.dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
