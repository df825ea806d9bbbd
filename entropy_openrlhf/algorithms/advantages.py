"""Outcome advantages from one scalar reward per response, registered by name like the objectives.

`rewards` is a flat (N,) tensor; `group_ids` (N,) says which prompt each response answers (responses of one prompt
share an id; groups need not be contiguous). Every estimator returns one advantage per response, which the trainer
broadcasts to that response's tokens.

An estimator is one function `(rewards, group_ids) -> (N,) advantages` decorated with `@register_estimator(name)`,
as verl's `core_algos.py` registers its own; `--algo.advantage NAME` picks it, and the flag's choices are the
registry's names, so a new estimator is one decorated function here (README, "Add an advantage estimator").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ESTIMATORS: dict[str, Estimator] = {}  # in registration order: --help and errors list them so
GRPO_EPS = 1e-6


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator over `fn(rewards, group_ids) -> (N,) advantages`: registers it as `--algo.advantage name`."""

    def wrap(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = fn
        return fn

    return wrap


def _groups(group_ids: torch.Tensor) -> list[torch.Tensor]:
    return [(group_ids == g).nonzero().squeeze(-1) for g in torch.unique(group_ids)]


@register_estimator("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-6), std unbiased (Bessel) as in verl; a group of one gets 0.

    scale_by_std=False is Dr.GRPO: the mean is removed, the std is not divided out.
    """
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids):
        if idx.numel() < 2:
            continue  # no baseline exists for a lone response (verl would pass its raw reward through)
        r = rewards[idx]
        centred = r - r.mean()
        adv[idx] = centred / (r.std(unbiased=True) + GRPO_EPS) if scale_by_std else centred
    return adv


@register_estimator("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: GRPO's group mean removed, its std not divided out (no per-prompt difficulty weighting)."""
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


@register_estimator("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean of the other responses of its prompt; a group of one gets 0."""
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids):
        k = idx.numel()
        if k < 2:
            continue
        r = rewards[idx]
        adv[idx] = r - (r.sum() - r) / (k - 1)
    return adv


@register_estimator("reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++: the rewards whitened over the whole batch (mean 0, std 1); no per-prompt baseline, so
    `group_ids` is not read (it is there for the registry's common signature)."""
    rewards = rewards.float()
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + GRPO_EPS)


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo") -> torch.Tensor:
    """The advantages of estimator `estimator` (a registered name)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[estimator](rewards, group_ids)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) per-response advantages -> (N, L) per-token, 0 on padding."""
    return advantages.float().unsqueeze(-1) * mask.float()


# --------------------------------------------------------------------------- per-token shaping (not an estimator)


def check_entropy_advantage(alpha: float, kappa: float) -> None:
    """alpha finite and >= 0; kappa finite and >= 1 (below 1 the bonus could flip a negative advantage's sign)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha={alpha!r} must be a finite number >= 0 (0: no shaping)")
    if isinstance(kappa, bool) or not isinstance(kappa, (int, float)) or not (math.isfinite(kappa) and kappa >= 1):
        raise ValueError(
            f"kappa={kappa!r} must be a finite number >= 1: the bonus is capped at |A| / kappa, and below 1 it could "
            "turn a negative advantage positive"
        )


def entropy_advantage(
    advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *, alpha: float = 0.4, kappa: float = 2.0
) -> torch.Tensor:
    """Cheng et al.'s entropy-based advantage (arXiv 2506.14758; docs/algorithms/losses.md, 'Entropy-based
    advantage'): A' = A + min(alpha * sg(H), |A| / kappa) on valid tokens, 0 on padding. A float32 (B, L) tensor
    without a gradient.

    H is the current policy's token entropy. The cap |A| / kappa keeps the sign of every advantage for kappa > 1
    (a negative one is softened to at most A (1 - 1/kappa)), and a zero advantage gets no bonus. Unlike the
    estimators above it is per token and needs the policy's entropy, so the trainer applies it inside each loss call
    (`--algo.entropy_adv_alpha`); the defaults are the third-party implementations' GRPO values, unverified against
    the paper. Inputs are not modified; NaN/Inf on padding never enters the arithmetic.
    """
    check_entropy_advantage(alpha, kappa)
    if not (advantages.shape == entropy.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: advantages {tuple(advantages.shape)}, entropy {tuple(entropy.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    valid = mask.bool()
    adv = torch.where(valid, advantages.detach().float(), 0.0)
    h = torch.where(valid, entropy.detach().float(), 0.0)
    bonus = torch.minimum(alpha * h, adv.abs() / kappa)
    return torch.where(valid, adv + bonus, 0.0)


def entropy_advantage_metrics(
    advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *, alpha: float, kappa: float
) -> dict[str, float]:
    """What `entropy_advantage` does to one call's tokens: `entropy_adv_shift`, the mean of its bonus A' - A over the
    valid tokens, and `entropy_adv_capped_frac`, the share of the valid tokens with A != 0 whose bonus is the cap
    |A| / kappa rather than alpha * H (there the advantage, not the entropy, sets the bonus)."""
    valid = mask.bool()
    n = int(valid.sum())
    if n == 0:
        return {"entropy_adv_shift": 0.0, "entropy_adv_capped_frac": 0.0}
    adv = torch.where(valid, advantages.detach().float(), 0.0)
    h = torch.where(valid, entropy.detach().float(), 0.0)
    by_entropy, cap = alpha * h, adv.abs() / kappa
    nonzero = valid & (adv != 0)
    return {
        "entropy_adv_shift": float(torch.minimum(by_entropy, cap)[valid].sum()) / n,
        "entropy_adv_capped_frac": float((nonzero & (cap < by_entropy)).sum()) / max(int(nonzero.sum()), 1),
    }
