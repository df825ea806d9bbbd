"""Outcome advantages from one scalar reward per response, registered by name like the objectives.

`rewards` is a flat (N,) tensor; `group_ids` (N,) says which prompt each response answers (responses of one prompt
share an id; groups need not be contiguous). Every estimator returns one advantage per response, which the trainer
broadcasts to that response's tokens.

An estimator is one function `(rewards, group_ids) -> (N,) advantages` decorated with `@register_estimator(name)`,
as verl's `core_algos.py` registers its own; `--algo.advantage NAME` picks it, and the flag's choices are the
registry's names, so a new estimator is one decorated function here (README, "Add an advantage estimator").
"""

from __future__ import annotations

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
