"""Selection scope `global`: one covariance selection over the whole optimizer mini-batch, across ranks.

The reference code selects per micro-batch on each GPU (docs/algorithms/losses.md, 'Selection scope'), so its choice
depends on
micro-batch size and GPU count (verl#7818). The paper defines the covariance over the training batch. Here the
valid tokens of every micro-batch of the mini-batch are flattened in order, gathered from all data-parallel ranks,
the means and the selection are computed once over all of them, and each micro-batch gets its slice back as the
`selected=` mask of `clip_cov_loss` / `kl_cov_loss`.

Every rank computes the same selection from the same gathered values; for Clip-Cov's random draw that needs the
same generator seed on every rank (the trainer seeds it by step, not by rank, in this scope). Any objective with a
selector (the covariance ones, the high-entropy one) selects this way through `pooled_selection`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from entropy_openrlhf.algorithms.objectives import LossContext, TokenBatch, get_objective
from entropy_openrlhf.algorithms.objectives.clip_cov import ClipCovConfig
from entropy_openrlhf.algorithms.objectives.kl_cov import KLCovConfig


@dataclass
class MicroBatch:
    log_probs: torch.Tensor  # current policy, no grad needed
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def _comm_device(group=None) -> torch.device:
    """Where the collective's tensors must live: NCCL moves only CUDA tensors, gloo (and the rest) CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(local: torch.Tensor, group=None) -> tuple[torch.Tensor, int]:
    """All-gather a (k, n_local) CPU tensor whose n_local differs by rank.

    Returns the (k, n_total) concatenation in rank order (on CPU) and where this rank's columns start in it.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local, 0
    world = dist.get_world_size(group)
    device = _comm_device(group)
    size = torch.tensor([local.shape[1]], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros(local.shape[0], max(counts), dtype=local.dtype, device=device)
    padded[:, : local.shape[1]] = local.to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    offset = sum(counts[: dist.get_rank(group)])
    return torch.cat([p[:, :c] for p, c in zip(parts, counts, strict=True)], dim=1).cpu(), offset


class PooledSelection(NamedTuple):
    """What `pooled_selection` returns."""

    masks: list[torch.Tensor]  # one per micro-batch, of its shape
    means: tuple[float, float]  # pooled (advantage mean, log-prob mean): the losses' `cov_means=`, the same centring
    total: int  # tokens selected on all ranks
    metrics: dict[str, float]  # the selector's


def pooled_selection(
    micro_batches: Sequence[MicroBatch | TokenBatch],
    select: Callable[[TokenBatch, tuple[float, float]], tuple[torch.Tensor, dict[str, float]]],
    *,
    with_entropy: bool = False,
    with_weights: bool = False,
    group=None,
) -> PooledSelection:
    """Run `select` once over all valid tokens of `micro_batches` on all ranks of `group`.

    `select(pooled, means)` gets every valid token as a (1, N) TokenBatch (entropy included when `with_entropy`,
    the off-policy weights when `with_weights`: a micro-batch without them weighs 1) and the pooled (advantage
    mean, log-prob mean); it returns a (1, N) bool mask and metrics. Every rank must pass the same flags, since
    they set how many rows are gathered.
    """
    valids = [mb.mask.bool() for mb in micro_batches]
    pairs = list(zip(micro_batches, valids, strict=True))
    names = ["log_probs", "old_log_probs", "advantages"]
    names += (["entropy"] if with_entropy else []) + (["is_weights"] if with_weights else [])

    def row(mb: MicroBatch | TokenBatch, name: str) -> torch.Tensor:
        values = getattr(mb, name, None)
        if values is None:  # only the weights may be absent (a MicroBatch has none)
            values = torch.ones_like(mb.log_probs)
        return values.detach().float().cpu()

    # rows: one per input, every valid token in micro-batch then row-major order
    local = torch.stack([torch.cat([row(mb, name)[v.cpu()] for mb, v in pairs]) for name in names])
    n_local = local.shape[1]
    everything, offset = _gather_rows(local, group)
    rows = {name: everything[i : i + 1] for i, name in enumerate(names)}
    lp, adv = rows["log_probs"], rows["advantages"]
    means = (float(adv.mean()), float(lp.mean())) if lp.numel() else (0.0, 0.0)
    pooled = TokenBatch(lp, rows["old_log_probs"], adv, torch.ones_like(lp, dtype=torch.bool),
                        entropy=rows.get("entropy"), is_weights=rows.get("is_weights"))  # fmt: skip
    chosen, metrics = select(pooled, means)

    mine = chosen.view(-1)[offset : offset + n_local]
    masks, start = [], 0
    for mb, v in pairs:
        count = int(v.sum())
        sel = torch.zeros(v.shape, dtype=torch.bool)
        sel[v.cpu()] = mine[start : start + count]
        masks.append(sel.to(mb.mask.device))
        start += count
    return PooledSelection(masks, means, int(chosen.sum()), metrics)


def global_selection(
    micro_batches: Sequence[MicroBatch],
    method: Literal["clip_cov", "kl_cov"],
    *,
    ratio: float,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    bounds_unit: str = "abs",
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    generator: torch.Generator | None = None,
    group=None,
) -> tuple[list[torch.Tensor], tuple[float, float]]:
    """Clip-Cov's or KL-Cov's selection over all valid tokens of `micro_batches` on all ranks of `group`, from
    plain arguments. Returns one bool mask per micro-batch and the global (advantage mean, log-prob mean).

    It runs the objective's own selector from the registry, as the trainer's `--loss.scope global` does, so the
    two cannot drift apart; this form is for callers of the plain loss functions (their `selected=` and
    `cov_means=`), and the reference the trainer's update is tested against."""
    if method == "clip_cov":
        params: Any = ClipCovConfig(ratio=ratio, lb=cov_lb, ub=cov_ub, bounds_unit=bounds_unit)
    elif method == "kl_cov":
        params = KLCovConfig(ratio=ratio)
    else:
        raise ValueError(f"unknown selection method {method!r}; expected 'clip_cov' or 'kl_cov'")
    objective = get_objective(method)
    ctx = LossContext(clip_low=clip_low, clip_high=clip_high, generator=generator)

    def select(pooled: TokenBatch, means: tuple[float, float]) -> tuple[torch.Tensor, dict[str, float]]:
        return objective.select(pooled, params, dataclasses.replace(ctx, cov_means=means), None), {}

    pooled = pooled_selection(micro_batches, select, group=group)
    return pooled.masks, pooled.means
