"""Policy losses: PPO (with clip-higher and dual-clip), Clip-Cov, KL-Cov, high_entropy (80/20), CISPO and GSPO.

Plain functions over (B, L) tensors, as docs/losses.md states them (Clip-Cov and KL-Cov: arXiv 2505.22617;
high_entropy: arXiv 2506.01939; CISPO: arXiv 2506.13585; GSPO: arXiv 2507.18071). Each returns a `LossOutput` with
the scalar loss, the per-token loss matrix, the mask of the tokens the method selected and a metrics dict of floats.

Conventions shared by the losses:
- math in fp32 whatever the input dtype; the log ratio is clamped to [-20, 20] before `exp` (verl#6478);
- inputs are zeroed outside the mask first, so NaN/Inf on padding can leak into neither the loss nor the gradient;
- covariance-selected tokens stay in the denominator (Clip-Cov zeroes their numerator, KL-Cov adds beta*|d|);
  high_entropy is the exception: its mean runs over the entropy-selected tokens only;
- `ratio` is a fraction of valid tokens (2e-3 = 0.2 %), never a percent;
- aggregation follows OpenRLHF's `aggregate_loss`: with a `normalizer` (the valid tokens, or sequences, of the
  whole optimizer step across micro-batches and data-parallel ranks) each micro-batch returns its share of the
  global mean, so summing over micro-batches and ranks gives the same loss however the step is split;
- an empty mask gives a loss of 0 that still carries a gradient path, so `loss.backward()` always works.
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


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """The entropy bonus `-coef * H` to add to any objective's loss (`--loss.entropy_coef`).

    entropy: (B, L) token entropies of the current policy *with* their gradient (`token_entropy_with_grad`).
    H is aggregated exactly as the policy loss is (`aggregate`, same mode, normalizer and dp_size), so the bonus
    of a mini-batch does not depend on how it is split into micro-batches or ranks, and `coef` weighs it against the
    policy loss in the same units. Padding is zeroed before the product (its entropy may be NaN on garbage logits).
    Not importance-weighted: it regularises the current policy, not an estimate under the behaviour policy.
    """
    if not (math.isfinite(coef) and coef >= 0):
        raise ValueError(f"entropy bonus coefficient {coef!r} must be a finite number >= 0")
    if entropy.shape != mask.shape:
        raise ValueError(f"shape mismatch: entropy {tuple(entropy.shape)}, mask {tuple(mask.shape)}")
    valid = mask.bool()
    h = torch.where(valid, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    return -coef * aggregate(h, valid, agg, normalizer, dp_size)


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


def _weighted(token_loss: torch.Tensor, is_weights: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """token_loss * is_weights, the weights zeroed on padding first, so that a NaN weight there never enters the
    arithmetic (the masked `torch.where` downstream would hide it from the loss, but not from intermediate grads)."""
    if is_weights is None:
        return token_loss
    return token_loss * torch.where(valid, is_weights.float(), 0.0)


def _check_like(name: str, x: torch.Tensor | None, mask: torch.Tensor) -> None:
    if x is not None and x.shape != mask.shape:
        raise ValueError(f"shape mismatch: {name} {tuple(x.shape)}, mask {tuple(mask.shape)}")


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


def _quota_metrics(ratio: float, n_valid: int, selected: torch.Tensor) -> dict[str, float]:
    """Whether a covariance selection can act at this size: its quota max(1, floor(ratio * N)) over this call's
    valid tokens, and `select_starved` = 1 when the call selected nothing or its quota is the one-token floor
    (ratio * N < 1). Averaged over micro-batches they show an objective that barely acts (the trainer warns)."""
    floor_only = ratio * n_valid < 1
    return {
        "select_tokens": float(n_valid),
        "select_quota": float(max(1, math.floor(ratio * n_valid))),
        "select_starved": float(floor_only or not bool(selected.any())),
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
    token_loss = _weighted(token_loss, is_weights, valid)
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
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clip-Cov's choice: max(1, floor(ratio*N)) tokens drawn uniformly from those with cov_lb < c < cov_ub that
    PPO's clip has not already clipped. Works on any shape; returns a bool mask of the same shape.

    `candidates` restricts the choice to these tokens (e.g. the high-entropy ones); the quota and the covariance
    centring still count every valid token, so the restriction changes which tokens are picked, not how many.
    """
    check_ratio(ratio, "clip_cov ratio")
    _check_like("candidates", candidates, mask)
    _, _, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    _, unclipped, clipped = _ppo_terms(adv, log_ratio, clip_low, clip_high)
    ppo_clipped = (clipped > unclipped) & valid
    cov = token_covariance(log_probs, advantages, mask, cov_means)
    pool = valid & ~ppo_clipped & (cov > cov_lb) & (cov < cov_ub)
    if candidates is not None:
        pool = pool & candidates.bool()
    selected = torch.zeros_like(valid)
    cand_idx = pool.flatten().nonzero().squeeze(-1)
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
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL-Cov's choice: the max(1, floor(ratio*N)) valid tokens with the largest covariance (no bounds).

    `candidates` restricts the choice to these tokens (e.g. the high-entropy ones): the top-K among them, with K
    still counted from every valid token (at most the number of candidates) and the covariance still centred on
    every valid token.
    """
    check_ratio(ratio, "kl_cov ratio")
    _check_like("candidates", candidates, mask)
    valid = mask.bool()
    selected = torch.zeros_like(valid)
    n_valid = int(valid.sum())
    pool = valid if candidates is None else valid & candidates.bool()
    n_pool = int(pool.sum())
    if n_pool == 0:
        return selected
    cov = token_covariance(log_probs, advantages, mask, cov_means)
    if candidates is not None:
        cov = torch.where(pool, cov, float("-inf"))
    k = min(max(1, math.floor(ratio * n_valid)), n_pool)
    top = torch.topk(cov.flatten(), k).indices  # entries outside the pool are -inf, so never picked while k <= n_pool
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
    token_loss = _weighted(token_loss, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    n = max(int(valid.sum()), 1)
    cov = token_covariance(lp, adv, valid, cov_means)
    in_bounds = valid & (cov > cov_lb) & (cov < cov_ub)  # the candidates before PPO's clip takes its own
    metrics = {
        "clip_cov_frac": float(selected.sum()) / n,
        "clip_cov_in_bounds": float(in_bounds.sum()) / n,
        "ppo_kl": _masked_mean((old - lp).detach(), valid),
        **_clip_fracs(adv, ratio_t.detach(), valid, clip_low, clip_high),
        **_cov_metrics(cov, valid, selected),
        **_quota_metrics(ratio, int(valid.sum()), selected),
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
    token_loss = _weighted(token_loss, is_weights, valid)
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
        **_quota_metrics(ratio, int(valid.sum()), selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


# --------------------------------------------------------------------------- high_entropy (80/20), CISPO, GSPO


def _check_top_frac(top_frac: float) -> None:
    if isinstance(top_frac, bool) or not (isinstance(top_frac, (int, float)) and 0.0 <= top_frac <= 1.0):
        raise ValueError(
            f"top_frac={top_frac!r} must be a fraction of valid tokens in [0, 1]; 0.2 keeps the top 20 % by entropy"
        )


def _check_clip_widths(clip_low: float, clip_high: float) -> None:
    # a negative width would put the lower bound above the upper one, and torch.clamp then returns the upper bound
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip widths must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")


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
    _check_like("entropy", entropy, mask)
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
    """PPO's clipped surrogate on the high-entropy tokens S only, averaged over S (docs/losses.md, 'high_entropy').

    loss = sum over S of max(-A*rho, -A*clip(rho)) / max(|S|, 1): the denominator counts the selected tokens, not
    all valid tokens. `selected`: a selection made over a wider scope (then `entropy` may be None);
    `normalizer`: the denominator to use instead of |S| (e.g. the selected count of the whole mini-batch on all
    ranks), in which case the loss is multiplied by `dp_size` as `aggregate` does.
    """
    _check_top_frac(top_frac)
    lp, old, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    _check_like("entropy", entropy, mask)
    if selected is None:
        if entropy is None:
            raise ValueError("high_entropy_loss needs `entropy` to select tokens, or a precomputed `selected=`")
        selected, tau = _entropy_top(entropy, valid, top_frac)
    else:
        _check_like("selected", selected, mask)
        selected = selected.bool() & valid
        # the threshold a wider selection used is not known here; its lowest selected entropy is the local bound
        tau = float(entropy.detach().float()[selected].min()) if entropy is not None and selected.any() else 0.0
    ratio, unclipped, clipped = _ppo_terms(adv, log_ratio, clip_low, clip_high)
    token_loss = _weighted(torch.maximum(unclipped, clipped), is_weights, valid)
    token_loss = torch.where(selected, token_loss, 0.0)
    n_valid = int(valid.sum())
    metrics = {
        "entropy_threshold": tau,
        "entropy_selected_frac": float(selected.sum()) / max(n_valid, 1),
        "ppo_kl": _masked_mean((old - lp).detach(), valid),
        # the clip acts on the selected tokens only, so its fractions are of those
        **_clip_fracs(adv, ratio.detach(), selected, clip_low, clip_high),
        **_cov_metrics(token_covariance(lp, adv, valid), valid, selected),
    }
    loss = aggregate(token_loss, selected, "token_mean", normalizer, dp_size)
    return LossOutput(loss, token_loss, selected, metrics)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 10.0,
    clip_high: float = 0.2,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """CISPO: -sg(clip(rho, 1 - clip_low, 1 + clip_high)) * A * logp on every valid token (docs/losses.md, 'CISPO').

    The clipped ratio is a constant weight, so the clip bounds a token's gradient instead of removing it. The loss
    value holds logp itself: it is not 0 on-policy and not comparable with PPO's. clip_low >= 1 leaves the weight
    unbounded below (the default 10 does, as the paper).
    """
    _check_clip_widths(clip_low, clip_high)
    lp, old, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.exp().detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = _weighted(-weight * adv * lp, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    clipped = valid & ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high))
    metrics = {
        "cispo_clip_frac": float(clipped.sum()) / max(int(valid.sum()), 1),
        "ppo_kl": _masked_mean((old - lp).detach(), valid),
        **_cov_metrics(token_covariance(lp, adv, valid), valid, valid),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, valid.clone(), metrics)


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
    """GSPO: PPO's clipped surrogate with one ratio per sequence, s_i = exp(mean_t d_t) (docs/losses.md, 'GSPO').

    d_t is clamped per token before the mean. In token form each token carries sg(s_i) * exp(lp_t - sg(lp_t)):
    value s_i, gradient s_i through the raw lp_t. Always seq-mean-token-mean; `normalizer` = the non-empty
    sequences of the whole mini-batch on all ranks (then the loss is multiplied by `dp_size`).
    """
    _check_clip_widths(clip_low, clip_high)
    lp, old, adv, valid, log_ratio = _prepare(log_probs, old_log_probs, advantages, mask)
    m = valid.float()
    n_tok = m.sum(-1)
    nonempty = n_tok > 0
    # padding is 0 in log_ratio already (both inputs were zeroed); the clamp to +-20 per token bounds the mean too
    log_seq = ((log_ratio * m).sum(-1) / n_tok.clamp(min=1.0)).detach()
    seq_ratio = log_seq.exp().unsqueeze(-1) * (lp - lp.detach()).exp()
    unclipped = -adv * seq_ratio
    clipped = -adv * seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = _weighted(torch.maximum(unclipped, clipped), is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    # a sequence counts as clipped when the clip removes the gradient of its tokens (all of them when A is constant
    # over the sequence, as with GRPO)
    seq_clipped = (valid & (clipped > unclipped).detach()).any(-1)
    n_seq = int(nonempty.sum())
    metrics = {
        "gspo_clip_frac": float(seq_clipped.sum()) / max(n_seq, 1),
        "seq_log_ratio_mean": float(log_seq[nonempty].mean()) if n_seq else 0.0,
        "ppo_kl": _masked_mean((old - lp).detach(), valid),
        **_cov_metrics(token_covariance(lp, adv, valid), valid, valid),
    }
    loss = aggregate(token_loss, valid, "seq_mean_token_mean", normalizer, dp_size)
    return LossOutput(loss, token_loss, valid.clone(), metrics)
