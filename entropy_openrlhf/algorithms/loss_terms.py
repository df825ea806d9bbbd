"""What several policy losses share: their output, aggregation, covariance, PPO's ratio terms and metrics.

The objectives (algorithms/objectives/, one file each) build their losses from these; `algorithms/losses.py`
re-exports the public names with every objective's plain function. The conventions the losses keep:
- math in fp32 whatever the input dtype; the log ratio is clamped to [-20, 20] before `exp` (verl#6478);
- inputs are zeroed outside the mask first, so NaN/Inf on padding can leak into neither the loss nor the gradient;
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

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGG_MODES: tuple[str, ...] = AggMode.__args__  # --loss.agg's choices
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
    norm_len: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, L) loss matrix to a scalar, as OpenRLHF's `aggregate_loss` and verl's `agg_loss` do.

    token_mean: sum over valid tokens / N_tokens (DAPO's; verl token-mean, TRL bnpo/dapo).
    seq_mean_token_mean: each sequence's token mean, averaged over the non-empty sequences (GRPO's; TRL grpo).
    seq_mean_token_sum: each sequence's token sum, averaged over the non-empty sequences.
    seq_mean_token_sum_norm: each sequence's token sum / `norm_len`, averaged over the non-empty sequences: Dr.GRPO's
      constant normaliser (the generation limit) in place of each response's length (TRL dr_grpo).
    N_tokens and the number of sequences are this call's own, unless `normalizer` gives them for the whole
    optimizer step (for seq_mean_token_sum_norm: sequences x norm_len, `LossContext.normalizer`), so that summing
    the micro-batches' results gives the step's loss however it is split. With a normalizer the result is multiplied
    by `dp_size`, undoing the gradient averaging across data-parallel ranks. `norm_len` defaults to the matrix's
    width. A zero count gives a zero loss that still carries a gradient path.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    scale = 1.0 if normalizer is None else float(dp_size)
    mask = mask.to(token_loss.dtype)
    if mode == "token_mean":
        denom = mask.sum() if normalizer is None else torch.tensor(float(normalizer), dtype=token_loss.dtype)
        return (token_loss * mask).sum() / denom.clamp(min=1.0) * scale
    tokens = mask.sum(-1)
    sums = (token_loss * mask).sum(-1)
    per_seq = sums / tokens.clamp(min=1.0) if mode == "seq_mean_token_mean" else sums
    if normalizer is None:
        denom = (tokens > 0).sum().to(token_loss.dtype)
        if mode == "seq_mean_token_sum_norm":
            denom = denom * float(norm_len if norm_len is not None else mask.shape[-1])
    else:
        denom = torch.tensor(float(normalizer), dtype=token_loss.dtype)
    return per_seq.sum() / denom.clamp(min=1.0) * scale


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


def prepare(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> float:
    n = int(valid.sum())
    return float(x[valid].sum() / n) if n else 0.0


def weighted(token_loss: torch.Tensor, is_weights: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """token_loss * is_weights, the weights zeroed on padding first, so that a NaN weight there never enters the
    arithmetic (the masked `torch.where` downstream would hide it from the loss, but not from intermediate grads)."""
    if is_weights is None:
        return token_loss
    return token_loss * torch.where(valid, is_weights.float(), 0.0)


def live_candidates(
    mask: torch.Tensor, is_weights: torch.Tensor | None, candidates: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Where Clip-Cov and KL-Cov may choose: `candidates` (None: every valid token) less the tokens the off-policy
    correction rejected (weight 0). Their loss is multiplied by 0, so a slot of the quota spent on one would act on
    nothing; they still count in the quota's N and the covariance's centring, as they stay in the loss normaliser
    (docs/algorithms/off_policy.md). None when nothing restricts the choice."""
    if is_weights is None:
        return candidates
    live = (is_weights > 0) & mask.bool()
    return live if candidates is None else live & candidates.bool()


def check_like(name: str, x: torch.Tensor | None, mask: torch.Tensor) -> None:
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
        means = (masked_mean(adv, valid), masked_mean(lp, valid))
    cov = (adv - means[0]) * (lp - means[1])
    return torch.where(valid, cov, float("-inf"))


def ppo_terms(
    adv: torch.Tensor, log_ratio: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's ratio exp(log_ratio) and its two surrogate terms, -A*rho and -A*clip(rho, 1 - low, 1 + high)."""
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return ratio, unclipped, clipped


def cov_metrics(cov: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor) -> dict[str, float]:
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


def selection_quota(ratio: float, n_valid: int) -> int:
    """Tokens a covariance selection takes from `n_valid`: max(1, floor(ratio * N)), as the reference code does
    (so at least one token, however small the batch)."""
    return max(1, math.floor(ratio * n_valid))


def quota_metrics(ratio: float, n_valid: int, selected: torch.Tensor) -> dict[str, float]:
    """Whether a covariance selection can act at this size: its quota max(1, floor(ratio * N)) over this call's
    valid tokens, and `select_starved` = 1 when the call selected nothing or its quota is the one-token floor
    (ratio * N < 1). Averaged over micro-batches they show an objective that barely acts (the trainer warns)."""
    floor_only = ratio * n_valid < 1
    return {
        "select_tokens": float(n_valid),
        "select_quota": float(selection_quota(ratio, n_valid)),
        "select_starved": float(floor_only or not bool(selected.any())),
    }


def clip_fracs(
    adv: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor, clip_low: float, clip_high: float
) -> dict[str, float]:
    # Tokens whose ratio the PPO clip holds at a bound, i.e. whose gradient the clip removes.
    low = valid & (adv < 0) & (ratio < 1.0 - clip_low)
    high = valid & (adv > 0) & (ratio > 1.0 + clip_high)
    n = max(int(valid.sum()), 1)
    return {"ppo_clip_frac_low": float(low.sum()) / n, "ppo_clip_frac_high": float(high.sum()) / n}


def check_clip_widths(clip_low: float, clip_high: float) -> None:
    # a negative width would put the lower bound above the upper one, and torch.clamp then returns the upper bound
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip widths must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
