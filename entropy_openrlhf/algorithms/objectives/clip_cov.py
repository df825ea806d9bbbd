"""Clip-Cov (arXiv 2505.22617): PPO with the gradient of a few random high-covariance tokens stopped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import (
    AggMode,
    LossOutput,
    aggregate,
    check_like,
    check_ratio,
    clip_fracs,
    cov_metrics,
    live_candidates,
    masked_mean,
    ppo_terms,
    prepare,
    quota_metrics,
    selection_quota,
    token_covariance,
    weighted,
)
from entropy_openrlhf.algorithms.objectives.base import Knob, LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option
from entropy_openrlhf.presets import PRESETS

BOUNDS_UNITS = ("abs", "std")


def covariance_bounds(cov: torch.Tensor, valid: torch.Tensor, lb: float, ub: float, unit: str) -> tuple[float, float]:
    """The candidates' open interval (lo, hi) of token covariance. "abs": (lb, ub) as given, the paper's numbers,
    set on 7B runs. "std": lb and ub in units of the standard deviation of the covariances of the valid tokens here
    (the micro-batch, or the pooled mini-batch under --loss.scope global), so that the band follows covariances
    that shrink as a small model trains (docs/algorithms/losses.md, 'At small scale')."""
    if unit == "abs":
        return lb, ub
    if unit != "std":
        raise ValueError(f"clip_cov bounds unit {unit!r}: one of {', '.join(BOUNDS_UNITS)}")
    values = cov[valid.bool()]
    scale = float(values.std(unbiased=False)) if values.numel() > 1 else 0.0
    return lb * scale, ub * scale


def clip_cov_select(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    bounds_unit: str = "abs",
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    generator: torch.Generator | None = None,
    cov_means: tuple[float, float] | None = None,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clip-Cov's choice: max(1, floor(ratio*N)) tokens drawn uniformly from those with lo < c < hi that PPO's clip
    has not already clipped, (lo, hi) = `covariance_bounds(cov_lb, cov_ub, bounds_unit)`. Works on any shape;
    returns a bool mask of the same shape.

    `candidates` restricts the choice to these tokens (e.g. the high-entropy ones); the quota and the covariance
    centring still count every valid token, so the restriction changes which tokens are picked, not how many.
    """
    check_ratio(ratio, "clip_cov ratio")
    check_like("candidates", candidates, mask)
    _, _, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    _, unclipped, clipped = ppo_terms(adv, log_ratio, clip_low, clip_high)
    ppo_clipped = (clipped > unclipped) & valid
    cov = token_covariance(log_probs, advantages, mask, cov_means)
    lo, hi = covariance_bounds(cov, valid, cov_lb, cov_ub, bounds_unit)
    pool = valid & ~ppo_clipped & (cov > lo) & (cov < hi)
    if candidates is not None:
        pool = pool & candidates.bool()
    selected = torch.zeros_like(valid)
    cand_idx = pool.flatten().nonzero().squeeze(-1)
    if cand_idx.numel() > 0:
        quota = selection_quota(ratio, int(valid.sum()))
        # randperm on CPU: the generator (seeded per rank and step by the trainer) makes the draw reproducible.
        perm = torch.randperm(cand_idx.numel(), generator=generator).to(cand_idx.device)
        selected.view(-1)[cand_idx[perm[:quota]]] = True
    return selected


def clip_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    bounds_unit: str = "abs",
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    generator: torch.Generator | None = None,
    selected: torch.Tensor | None = None,
    cov_means: tuple[float, float] | None = None,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """PPO with the gradient of a few random high-covariance tokens stopped (docs/algorithms/losses.md, 'Clip-Cov').

    `selected`: a precomputed selection (global scope); otherwise it is drawn here over this micro-batch.
    """
    check_ratio(ratio, "clip_cov ratio")
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    if selected is None:
        selected = clip_cov_select(
            log_probs, old_log_probs, advantages, mask, ratio=ratio, cov_lb=cov_lb, cov_ub=cov_ub,
            bounds_unit=bounds_unit, clip_low=clip_low, clip_high=clip_high, generator=generator, cov_means=cov_means,
            candidates=live_candidates(mask, is_weights),
        )  # fmt: skip
    selected = selected.bool() & valid
    ratio_t, unclipped, clipped = ppo_terms(adv, log_ratio, clip_low, clip_high)
    token_loss = torch.maximum(unclipped, clipped) * (~selected).float()
    token_loss = weighted(token_loss, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    n = max(int(valid.sum()), 1)
    cov = token_covariance(lp, adv, valid, cov_means)
    lo, hi = covariance_bounds(cov, valid, cov_lb, cov_ub, bounds_unit)
    in_bounds = valid & (cov > lo) & (cov < hi)  # the candidates before PPO's clip takes its own
    metrics = {
        "clip_cov_frac": float(selected.sum()) / n,
        "clip_cov_in_bounds": float(in_bounds.sum()) / n,
        "clip_cov_lb": lo,  # in covariance units, whatever --loss.clip_cov.bounds_unit
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        **clip_fracs(adv, ratio_t.detach(), valid, clip_low, clip_high),
        **cov_metrics(cov, valid, selected),
        **quota_metrics(ratio, int(valid.sum()), selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class ClipCovConfig:
    ratio: float = option(2e-4, "fraction of valid tokens whose gradient is stopped (paper: 2e-4)")
    lb: float = option(1.0, "lower covariance bound of the candidates (paper: 1)")
    ub: float = option(5.0, "upper covariance bound of the candidates (paper: 5)")
    bounds_unit: str = option(
        "abs", "{choices}: lb and ub as covariances (abs, the paper's) or as multiples of the standard deviation "
        "of the token covariances of each selection (std: follows covariances that shrink as a small model trains; "
        "--preset clip-cov-small)", choices=BOUNDS_UNITS,
    )  # fmt: skip
    within: str = option(
        "", "choose only among the tokens another selector picks: '' (all) | high_entropy (the top "
        "--loss.high_entropy.top_frac by entropy); the quota still counts every valid token",
    )  # fmt: skip


def select(batch: TokenBatch, params: ClipCovConfig, ctx: LossContext, candidates: torch.Tensor | None):
    return clip_cov_select(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, ratio=params.ratio, cov_lb=params.lb,
        cov_ub=params.ub, bounds_unit=params.bounds_unit, clip_low=ctx.clip_low, clip_high=ctx.clip_high,
        generator=ctx.generator, cov_means=ctx.cov_means,
        candidates=live_candidates(batch.mask, batch.is_weights, candidates),
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


def run_note(params: ClipCovConfig, metrics: dict[str, float]) -> str:
    """Clip-Cov at its floor detaches at most one token per micro-batch, often none: the method barely acts. Says
    so with the numbers, and points to the setting that gives it room (the small-scale preset), or, when the run
    already has that much room, to the bounds and the ratio."""
    tokens = metrics.get("loss/select_tokens", 0.0)
    in_bounds = metrics.get("loss/clip_cov_in_bounds", 0.0)
    lb = metrics.get("loss/clip_cov_lb", 0.0)
    unit = "" if params.bounds_unit == "abs" else f" x the covariance std (lower bound ~{lb:.3g})"
    text = (
        f"[entropy-openrlhf] clip_cov barely acts: for several steps every micro-batch selected nothing or only its "
        f"floor of one token (quota max(1, floor({params.ratio:g} x ~{tokens:.0f} tokens)); selected "
        f"{metrics.get('loss/clip_cov_frac', 0.0):.2%} of tokens; cov p99 {metrics.get('cov/p99', 0.0):.3g} against "
        f"bounds ({params.lb:g}, {params.ub:g}){unit}, {in_bounds:.1%} of tokens inside them). "
    )
    small = PRESETS["clip-cov-small"]
    at_least_as_wide = (
        params.bounds_unit == small["loss.clip_cov.bounds_unit"]
        and params.ratio >= small["loss.clip_cov.ratio"]
        and params.lb <= small["loss.clip_cov.lb"]
    )
    if at_least_as_wide:
        text += "Widen the bounds (--loss.clip_cov.lb, --loss.clip_cov.ub), raise --loss.clip_cov.ratio"
    else:
        text += (
            f"Use --preset clip-cov-small (ratio {small['loss.clip_cov.ratio']:g}, a quota of "
            f"{selection_quota(small['loss.clip_cov.ratio'], 4 * 30)} tokens in a 4 x 30-token micro-batch, "
            f"and bounds from {small['loss.clip_cov.lb']:g} covariance std, which "
            "follow covariances that shrink as training goes on)"
        )
    return text + (
        " or train larger micro-batches (--actor.micro_batch_size); docs/algorithms/losses.md, 'At small scale'."
    )


@register_objective(
    "clip_cov", ClipCovConfig, select=select, knobs=(Knob("ratio", cap=1.0),), validate=validate, notes=notes,
    run_note=run_note, summary="Clip-Cov: PPO with the gradient of random high-covariance tokens stopped",
)  # fmt: skip
def clip_cov(batch: TokenBatch, params: ClipCovConfig, ctx: LossContext) -> LossOutput:
    return clip_cov_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, ratio=params.ratio, cov_lb=params.lb,
        cov_ub=params.ub, bounds_unit=params.bounds_unit, clip_low=ctx.clip_low, clip_high=ctx.clip_high,
        generator=ctx.generator, selected=ctx.selected, cov_means=ctx.cov_means, agg=ctx.agg,
        normalizer=ctx.normalizer, dp_size=ctx.dp_size, is_weights=batch.is_weights,
    )  # fmt: skip
