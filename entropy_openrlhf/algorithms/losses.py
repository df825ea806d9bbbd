"""Policy losses: PPO (with clip-higher and dual-clip), Clip-Cov and KL-Cov.

Plain functions over (B, L) tensors, as docs/losses.md states them (arXiv 2505.22617). Each returns a
`LossOutput` with the scalar loss, the per-token loss matrix, the mask of covariance-selected tokens and a metrics
dict of floats.

Conventions shared by the three losses:
- math in fp32 whatever the input dtype; the log ratio is clamped to [-20, 20] before `exp` (verl#6478);
- inputs are zeroed outside the mask first, so NaN/Inf on padding can leak into neither the loss nor the gradient;
- covariance-selected tokens stay in the denominator (Clip-Cov zeroes their numerator, KL-Cov adds beta*|d|);
- `ratio` is a fraction of valid tokens (2e-3 = 0.2 %), never a percent;
- aggregation follows OpenRLHF's `aggregate_loss`: with a `normalizer` (the valid tokens, or sequences, of the
  whole optimizer step across micro-batches and data-parallel ranks) each micro-batch returns its share of the
  global mean, so summing over micro-batches and ranks gives the same loss however the step is split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

AggMode = Literal["token_mean", "seq_mean_token_mean"]
LOG_RATIO_CLAMP = 20.0


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    token_loss: torch.Tensor  # (B, L), zero where masked
    selected: torch.Tensor  # (B, L) bool, tokens chosen by covariance (all False for PPO)
    metrics: dict[str, float] = field(default_factory=dict)


def check_ratio(ratio: float, name: str = "ratio") -> None:
    if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise ValueError(
            f"{name}={ratio!r} must be a fraction of valid tokens in (0, 1]; "
            f"2e-3 means 0.2 % (the authors' k_percent=0.2 is ratio=0.002)"
        )


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Reduce a (B, L) loss matrix to a scalar, as OpenRLHF's `aggregate_loss` does.

    token_mean: sum over valid tokens / (normalizer or the number of valid tokens here).
    seq_mean_token_mean: each sequence's token mean, summed / (normalizer or the number of non-empty sequences here).
    With a normalizer the result is multiplied by `dp_size`, undoing the gradient averaging across data-parallel
    ranks. A zero count gives a zero loss that still carries a gradient path.
    """
    scale = 1.0 if normalizer is None else float(dp_size)
    mask = mask.to(token_loss.dtype)
    if mode == "token_mean":
        denom = mask.sum() if normalizer is None else torch.tensor(float(normalizer), dtype=token_loss.dtype)
        return (token_loss * mask).sum() / denom.clamp(min=1.0) * scale
    if mode == "seq_mean_token_mean":
        tokens = mask.sum(-1)
        seq_means = (token_loss * mask).sum(-1) / tokens.clamp(min=1.0)
        denom = (tokens > 0).sum().to(token_loss.dtype) if normalizer is None else torch.tensor(float(normalizer))
        return seq_means.sum() / denom.clamp(min=1.0) * scale
    raise ValueError(f"unknown aggregation mode {mode!r}; expected 'token_mean' or 'seq_mean_token_mean'")


def _prepare(log_probs, old_log_probs, advantages, mask):
    """fp32 copies with everything outside the mask set to 0, plus the clamped log ratio."""
    if not (log_probs.shape == old_log_probs.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)}, "
            f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}"
        )
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    lp = torch.where(valid, log_probs.float(), zero)
    old = torch.where(valid, old_log_probs.float(), zero)
    adv = torch.where(valid, advantages.float(), zero)
    log_ratio = (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return lp, old, adv, valid, log_ratio


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> float:
    n = int(valid.sum())
    return float(x[valid].sum() / n) if n else 0.0


def token_covariance(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    means: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Centred cross-product c = (A - mean A)(logp - mean logp), detached, -inf outside the mask.

    `means` = (advantage mean, log-prob mean) precomputed over a larger scope (the optimizer mini-batch across ranks);
    by default both means run over the valid tokens of these tensors.
    """
    valid = mask.bool()
    lp = torch.where(valid, log_probs.detach().float(), 0.0)
    adv = torch.where(valid, advantages.detach().float(), 0.0)
    if means is None:
        means = (_masked_mean(adv, valid), _masked_mean(lp, valid))
    cov = (adv - means[0]) * (lp - means[1])
    return torch.where(valid, cov, float("-inf"))


def _ppo_terms(adv, log_ratio, clip_low, clip_high):
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return ratio, unclipped, clipped


def _cov_metrics(cov: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor) -> dict[str, float]:
    vals = cov[valid]
    if vals.numel() == 0:
        return {"cov_mean": 0.0, "cov_p99": 0.0, "cov_max": 0.0, "cov_selected_mean": 0.0}
    sel = cov[selected]
    return {
        "cov_mean": float(vals.mean()),
        "cov_p99": float(torch.quantile(vals, 0.99)),
        "cov_max": float(vals.max()),
        "cov_selected_mean": float(sel.mean()) if sel.numel() else 0.0,
    }


def _clip_fracs(adv, ratio, valid, clip_low, clip_high) -> dict[str, float]:
    # Tokens whose ratio the PPO clip holds at a bound, i.e. whose gradient the clip removes.
    low = valid & (adv < 0) & (ratio < 1.0 - clip_low)
    high = valid & (adv > 0) & (ratio > 1.0 + clip_high)
    n = max(int(valid.sum()), 1)
    return {"ppo_clip_frac_low": float(low.sum()) / n, "ppo_clip_frac_high": float(high.sum()) / n}


def ppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped PPO surrogate; clip_high > clip_low is DAPO's clip-higher; `dual_clip` (> 1) bounds A<0 tokens."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1")
    lp, old, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    ratio, unclipped, clipped = _ppo_terms(adv, log_ratio, clip_low, clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * dual_clip), token_loss)
    if is_weights is not None:
        token_loss = token_loss * is_weights.float()
    token_loss = torch.where(valid, token_loss, 0.0)
    selected = torch.zeros_like(valid)
    metrics = {
        "ppo_kl": _masked_mean((old - lp).detach(), valid),
        **_clip_fracs(adv, ratio.detach(), valid, clip_low, clip_high),
        **_cov_metrics(token_covariance(lp, adv, valid), valid, selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


def clip_cov_select(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    generator: torch.Generator | None = None,
    cov_means: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Clip-Cov's choice: max(1, floor(ratio*N)) tokens drawn uniformly from those with cov_lb < c < cov_ub that
    PPO's clip has not already clipped. Works on any shape; returns a bool mask of the same shape."""
    check_ratio(ratio, "clip_cov ratio")
    _, _, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    _, unclipped, clipped = _ppo_terms(adv, log_ratio, clip_low, clip_high)
    ppo_clipped = (clipped > unclipped) & valid
    cov = token_covariance(log_probs, advantages, mask, cov_means)
    candidates = valid & ~ppo_clipped & (cov > cov_lb) & (cov < cov_ub)
    selected = torch.zeros_like(valid)
    cand_idx = candidates.flatten().nonzero().squeeze(-1)
    if cand_idx.numel() > 0:
        quota = max(1, math.floor(ratio * int(valid.sum())))
        # randperm on CPU: the generator (seeded per rank and step by the trainer) makes the draw reproducible.
        perm = torch.randperm(cand_idx.numel(), generator=generator).to(cand_idx.device)
        selected.view(-1)[cand_idx[perm[:quota]]] = True
    return selected


def kl_cov_select(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-3,
    cov_means: tuple[float, float] | None = None,
) -> torch.Tensor:
    """KL-Cov's choice: the max(1, floor(ratio*N)) valid tokens with the largest covariance (no bounds)."""
    check_ratio(ratio, "kl_cov ratio")
    valid = mask.bool()
    selected = torch.zeros_like(valid)
    n_valid = int(valid.sum())
    if n_valid == 0:
        return selected
    cov = token_covariance(log_probs, advantages, mask, cov_means)
    k = min(max(1, math.floor(ratio * n_valid)), n_valid)
    top = torch.topk(cov.flatten(), k).indices  # masked entries are -inf, so never picked while k <= n_valid
    selected.view(-1)[top] = True
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
    """PPO with the gradient of a few random high-covariance tokens stopped (docs/losses.md, 'Clip-Cov').

    `selected`: a precomputed selection (global scope); otherwise it is drawn here over this micro-batch.
    """
    check_ratio(ratio, "clip_cov ratio")
    lp, old, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    if selected is None:
        selected = clip_cov_select(
            log_probs, old_log_probs, advantages, mask, ratio=ratio, cov_lb=cov_lb, cov_ub=cov_ub,
            clip_low=clip_low, clip_high=clip_high, generator=generator, cov_means=cov_means,
        )  # fmt: skip
    selected = selected.bool() & valid
    ratio_t, unclipped, clipped = _ppo_terms(adv, log_ratio, clip_low, clip_high)
    token_loss = torch.maximum(unclipped, clipped) * (~selected).float()
    if is_weights is not None:
        token_loss = token_loss * is_weights.float()
    token_loss = torch.where(valid, token_loss, 0.0)
    n = max(int(valid.sum()), 1)
    metrics = {
        "clip_cov_frac": float(selected.sum()) / n,
        "ppo_kl": _masked_mean((old - lp).detach(), valid),
        **_clip_fracs(adv, ratio_t.detach(), valid, clip_low, clip_high),
        **_cov_metrics(token_covariance(lp, adv, valid, cov_means), valid, selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


def kl_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-3,
    coef: float = 1.0,
    selected: torch.Tensor | None = None,
    cov_means: tuple[float, float] | None = None,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Unclipped policy gradient plus coef*|logp - old_logp| on the top-covariance tokens (docs/losses.md, 'KL-Cov').

    On a purely on-policy update (logp == old_logp) the penalty and its gradient are zero: KL-Cov acts from the
    second optimizer step of a rollout batch on.
    """
    check_ratio(ratio, "kl_cov ratio")
    lp, old, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    if selected is None:
        selected = kl_cov_select(log_probs, advantages, mask, ratio=ratio, cov_means=cov_means)
    selected = selected.bool() & valid
    token_loss = -adv * log_ratio.exp() + coef * log_ratio.abs() * selected.float()
    if is_weights is not None:
        token_loss = token_loss * is_weights.float()
    token_loss = torch.where(valid, token_loss, 0.0)
    abs_kl = log_ratio.detach().abs()
    n = max(int(valid.sum()), 1)
    metrics = {
        "kl_cov_frac": float(selected.sum()) / n,
        "ppo_kl": _masked_mean(abs_kl, valid),  # |d|, as verl reports it for KL-Cov
        "kl_selected": _masked_mean(abs_kl, selected),
        "ppo_clip_frac_low": 0.0,  # KL-Cov applies no PPO clip
        "ppo_clip_frac_high": 0.0,
        **_cov_metrics(token_covariance(lp, adv, valid, cov_means), valid, selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)
