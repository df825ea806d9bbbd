"""DPPO (divergence proximal policy optimisation): a trust region measured by how far the sampled token's probability
moved (binary total variation, or binary KL), not by the ratio. A token leaves the loss only once it moved out of the
region in the direction its advantage pushes; the others take PPO's unclipped gradient with a truncated importance
weight."""

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

DIVERGENCES = ("tv", "kl")
# the paper's recommended thresholds as TRL's DPPOConfig documents them (verl's example: 0.15 / 0.05): a probability
# for TV, nats for the binary KL, so each divergence has its own
DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}
KL_EPS = 1e-8  # verl's, the authors' and SkyRL's guard in log((1 - pbar) / (1 - p))


def dppo_deltas(divergence: str, delta_low: float | None, delta_high: float | None) -> tuple[float, float]:
    """The thresholds in use: each given one, else the divergence's default. Raises ValueError naming the field."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence={divergence!r} must be one of {', '.join(DIVERGENCES)}")
    out = []
    for name, delta in (("delta_low", delta_low), ("delta_high", delta_high)):
        if delta is None:
            delta = DEFAULT_DELTA[divergence]
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (math.isfinite(delta) and delta >= 0):
            raise ValueError(f"{name}={delta!r} must be a finite number >= 0 (None: the divergence's default)")
        out.append(float(delta))
    return out[0], out[1]


def check_tis_cap(tis_cap: float | None) -> None:
    if tis_cap is not None and (isinstance(tis_cap, bool) or not isinstance(tis_cap, (int, float)) or not tis_cap > 0):
        raise ValueError(f"tis_cap={tis_cap!r} must be None (no truncation) or a number > 0")


def binary_divergence(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, divergence: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, pbar, D), detached: the sampled token's probability under the current and the old policy, from the raw
    log-probs (not the clamped ratio), and the divergence between the two restricted to {the sampled token,
    everything else}: TV |p - pbar|, or KL(Bern(pbar) || Bern(p)), the old policy first. The log-probs are held at
    most 0 first: one a rounding error above 0 would make 1 - p negative and the binary KL NaN."""
    lp, old = log_probs.detach().clamp(max=0.0), old_log_probs.detach().clamp(max=0.0)
    p, pbar = lp.exp(), old.exp()
    if divergence == "tv":
        return p, pbar, (p - pbar).abs()
    rest = torch.log((1.0 - pbar + KL_EPS) / (1.0 - p + KL_EPS))
    return p, pbar, pbar * (old - lp) + (1.0 - pbar) * rest


def dppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergence: str = "tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    tis_cap: float | None = 20.0,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """DPPO: -A * sg(min(rho, tis_cap)) * M * logp per valid token (docs/algorithms/losses.md, 'DPPO').

    M = 0 where the probability already moved beyond the trust region in the direction A pushes: for A > 0 raised by
    more than delta_high (tv: p - pbar > delta_high; kl: D > delta_high and p > pbar), for A < 0 lowered by more than
    delta_low; zero-advantage tokens are never masked. delta None: 0.15 for tv, 0.05 for kl; tis_cap None: no
    truncation. Masked tokens stay in the denominator. `selected` = the valid tokens inside the region (M = 1).
    Like CISPO's, the loss value holds logp itself; its gradient is PPO's unclipped one, -A * min(rho, tis_cap).
    """
    low, high = dppo_deltas(divergence, delta_low, delta_high)
    check_tis_cap(tis_cap)
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.exp().detach()
    p, pbar, div = binary_divergence(lp, old, divergence)
    if divergence == "tv":
        out_high, out_low = p - pbar > high, p - pbar < -low
    else:
        out_high, out_low = (div > high) & (p > pbar), (div > low) & (p < pbar)
    masked_high = valid & (adv > 0) & out_high
    masked_low = valid & (adv < 0) & out_low
    keep = valid & ~(masked_high | masked_low)
    weight = ratio if tis_cap is None else ratio.clamp(max=tis_cap)
    token_loss = torch.where(keep, -adv * weight * lp, 0.0)
    token_loss = weighted(token_loss, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    n = max(int(valid.sum()), 1)
    truncated = keep & (ratio > tis_cap) if tis_cap is not None else torch.zeros_like(keep)
    metrics = {
        "dppo_masked_frac": float((masked_high | masked_low).sum()) / n,
        "dppo_masked_frac_high": float(masked_high.sum()) / n,
        "dppo_masked_frac_low": float(masked_low.sum()) / n,
        "dppo_tis_frac": float(truncated.sum()) / n,
        "dppo_divergence_mean": masked_mean(div, valid),
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        **cov_metrics(token_covariance(lp, adv, valid), valid, keep),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, keep, metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class DPPOConfig:
    divergence: str = option(
        "tv", "{choices}: the trust region's measure, the change of the sampled token's probability (tv) or the "
        "binary KL(old || new) (kl)", choices=DIVERGENCES,
    )  # fmt: skip
    delta_low: float = option(
        0.0, "how far a token with A < 0 may lower its probability before it is masked (a probability for tv, nats "
        "for kl; not a ratio width); 0 = the divergence's default, 0.15 for tv, 0.05 for kl",
    )  # fmt: skip
    delta_high: float = option(
        0.0, "how far a token with A > 0 may raise its probability before it is masked; 0 = the divergence's "
        "default, 0.15 for tv, 0.05 for kl",
    )  # fmt: skip
    tis_cap: float = option(
        20.0, "the truncated importance weight's cap, min(rho, tis_cap) on the kept tokens (TRL's 20); 0 = no "
        "truncation (verl's example)",
    )  # fmt: skip

    def deltas(self) -> tuple[float | None, float | None]:
        """The plain function's delta_low/delta_high: None (the divergence's default) where the flag is 0."""
        return self.delta_low or None, self.delta_high or None


def validate(params: DPPOConfig, cfg) -> list[str]:
    errors = []
    for flag, delta in (("--loss.dppo.delta_low", params.delta_low), ("--loss.dppo.delta_high", params.delta_high)):
        if not (math.isfinite(delta) and delta >= 0):
            errors.append(f"{flag}: {delta} must be a finite number >= 0 (0 = the divergence's default)")
    if not params.tis_cap >= 0:  # NaN fails the comparison too
        errors.append(f"--loss.dppo.tis_cap: {params.tis_cap} must be > 0, or 0 for no truncation")
    return errors


@register_objective(
    "dppo", DPPOConfig, validate=validate,
    summary="DPPO: a trust region on the sampled token's probability change (binary TV or KL), truncated IS",
)  # fmt: skip
def dppo(batch: TokenBatch, params: DPPOConfig, ctx: LossContext) -> LossOutput:
    delta_low, delta_high = params.deltas()
    return dppo_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, divergence=params.divergence,
        delta_low=delta_low, delta_high=delta_high, tis_cap=params.tis_cap or None, agg=ctx.agg,
        normalizer=ctx.normalizer, dp_size=ctx.dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
