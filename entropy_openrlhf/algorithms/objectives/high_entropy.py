"""The 80/20 "forking tokens" method (Wang et al. 2025, arXiv 2506.01939): PPO's clipped surrogate on the
top-entropy fraction of tokens only, averaged over those tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import (
    LossOutput,
    aggregate,
    check_like,
    clip_fracs,
    cov_metrics,
    masked_mean,
    ppo_terms,
    prepare,
    token_covariance,
    weighted,
)
from entropy_openrlhf.algorithms.objectives.base import Knob, LossContext, TokenBatch, register_objective
from entropy_openrlhf.options import option


def _check_top_frac(top_frac: float) -> None:
    if isinstance(top_frac, bool) or not (isinstance(top_frac, (int, float)) and 0.0 <= top_frac <= 1.0):
        raise ValueError(
            f"top_frac={top_frac!r} must be a fraction of valid tokens in [0, 1]; 0.2 keeps the top 20 % by entropy"
        )


def _entropy_top(entropy: torch.Tensor, valid: torch.Tensor, top_frac: float) -> tuple[torch.Tensor, float]:
    """The high-entropy selection and its threshold tau (0.0 when nothing is valid)."""
    n_valid = int(valid.sum())
    if n_valid == 0:
        return torch.zeros_like(valid), 0.0
    # Python-float arithmetic on purpose: a ceiling with a 1e-4 guard, so that 0.07 * 100 = 7.000000000000001 keeps
    # 7 tokens where math.ceil would keep 8.
    k = min(max(1, int(top_frac * n_valid + 0.9999)), n_valid)
    h = entropy.detach().float()
    # torch.topk ranks NaN above everything: padding (and any NaN) becomes -inf, which is never among the first
    # k <= n_valid values.
    h = torch.where(valid & ~h.isnan(), h, float("-inf"))
    tau = torch.topk(h.flatten(), k).values[-1]  # the k-th largest, counting repeated values
    return valid & (h >= tau), float(tau)


def high_entropy_select(entropy: torch.Tensor, mask: torch.Tensor, *, top_frac: float = 0.2) -> torch.Tensor:
    """The valid tokens whose entropy is at least the k-th largest, k = max(1, int(top_frac*N + 0.9999)) <= N.

    Ties at the threshold are all kept, so the count may exceed k (a reproducible choice, unlike top-k's arbitrary
    tie-break). The scope is every valid token of the call, pooled across rows. Works on any shape; returns a bool
    mask of the same shape.
    """
    _check_top_frac(top_frac)
    check_like("entropy", entropy, mask)
    return _entropy_top(entropy, mask.bool(), top_frac)[0]


def high_entropy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    top_frac: float = 0.2,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    selected: torch.Tensor | None = None,
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """PPO's clipped surrogate on the high-entropy tokens S only, averaged over S (docs/algorithms/losses.md,
    'high_entropy').

    loss = sum over S of max(-A*rho, -A*clip(rho)) / max(|S|, 1): the denominator counts the selected tokens, not
    all valid tokens. `selected`: a selection made over a wider scope (then `entropy` may be None);
    `normalizer`: the denominator to use instead of |S| (e.g. the selected count of the whole mini-batch on all
    ranks), in which case the loss is multiplied by `dp_size` as `aggregate` does.
    """
    _check_top_frac(top_frac)
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    check_like("entropy", entropy, mask)
    if selected is None:
        if entropy is None:
            raise ValueError("high_entropy_loss needs `entropy` to select tokens, or a precomputed `selected=`")
        selected, tau = _entropy_top(entropy, valid, top_frac)
    else:
        check_like("selected", selected, mask)
        selected = selected.bool() & valid
        # the threshold a wider selection used is not known here; its lowest selected entropy is the local bound
        tau = float(entropy.detach().float()[selected].min()) if entropy is not None and selected.any() else 0.0
    ratio, unclipped, clipped = ppo_terms(adv, log_ratio, clip_low, clip_high)
    token_loss = weighted(torch.maximum(unclipped, clipped), is_weights, valid)
    token_loss = torch.where(selected, token_loss, 0.0)
    n_valid = int(valid.sum())
    metrics = {
        "entropy_threshold": tau,
        "entropy_selected_frac": float(selected.sum()) / max(n_valid, 1),
        "ppo_kl": masked_mean((old - lp).detach(), valid),
        # the clip acts on the selected tokens only, so its fractions are of those
        **clip_fracs(adv, ratio.detach(), selected, clip_low, clip_high),
        **cov_metrics(token_covariance(lp, adv, valid), valid, selected),
    }
    loss = aggregate(token_loss, selected, "token_mean", normalizer, dp_size)
    return LossOutput(loss, token_loss, selected, metrics)


# --------------------------------------------------------------------------- the objective, registered


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
