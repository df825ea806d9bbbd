"""Outcome advantages from one scalar reward per response.

`rewards` is a flat (N,) tensor; `group_ids` (N,) says which prompt each response answers (responses of one prompt
share an id; groups need not be contiguous). Every estimator returns one advantage per response, which the trainer
broadcasts to that response's tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
GRPO_EPS = 1e-6


def _groups(group_ids: torch.Tensor) -> list[torch.Tensor]:
    return [(group_ids == g).nonzero().squeeze(-1) for g in torch.unique(group_ids)]


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


def reinforce_pp_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: the rewards whitened over the whole batch (mean 0, std 1); no per-prompt baseline."""
    rewards = rewards.float()
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + GRPO_EPS)


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: Estimator = "grpo") -> torch.Tensor:
    if estimator == "grpo":
        return grpo_advantages(rewards, group_ids)
    if estimator == "dr_grpo":
        return grpo_advantages(rewards, group_ids, scale_by_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards)
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) per-response advantages -> (N, L) per-token, 0 on padding."""
    return advantages.float().unsqueeze(-1) * mask.float()
