"""KL-Cov (arXiv 2505.22617): unclipped policy gradient plus coef * |logp - old_logp| on the top-covariance
tokens."""

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
    check_like("candidates", candidates, mask)
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
    k = min(selection_quota(ratio, n_valid), n_pool)
    top = torch.topk(cov.flatten(), k).indices  # entries outside the pool are -inf, so never picked while k <= n_pool
    selected.view(-1)[top] = True
    return selected


def kl_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-3,
    coef: float = 1.0,
    ppo_clip: tuple[float, float] | None = None,
    selected: torch.Tensor | None = None,
    cov_means: tuple[float, float] | None = None,
    agg: AggMode = "token_mean",
    normalizer: float | None = None,
    dp_size: int = 1,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Unclipped policy gradient plus coef*|logp - old_logp| on the top-covariance tokens (docs/algorithms/losses.md,
    'KL-Cov').

    On a purely on-policy update (logp == old_logp) the penalty and its gradient are zero: KL-Cov acts from the
    second optimizer step of a rollout batch on.

    `ppo_clip` = (clip_low, clip_high): an ablation, not the paper's KL-Cov. The base loss becomes PPO's clipped
    surrogate, so that a comparison with PPO/GRPO isolates the penalty from the missing clip.
    """
    check_ratio(ratio, "kl_cov ratio")
    lp, old, adv, valid, log_ratio = prepare(log_probs, old_log_probs, advantages, mask)
    if selected is None:
        candidates = live_candidates(mask, is_weights)
        selected = kl_cov_select(log_probs, advantages, mask, ratio=ratio, cov_means=cov_means, candidates=candidates)
    selected = selected.bool() & valid
    if ppo_clip is None:
        base = -adv * log_ratio.exp()
        clip_metrics = {"ppo_clip_frac_low": 0.0, "ppo_clip_frac_high": 0.0}  # the paper's KL-Cov clips nothing
    else:
        ratio_t, unclipped, clipped = ppo_terms(adv, log_ratio, *ppo_clip)
        base = torch.maximum(unclipped, clipped)
        clip_metrics = clip_fracs(adv, ratio_t.detach(), valid, *ppo_clip)
    token_loss = base + coef * log_ratio.abs() * selected.float()
    token_loss = weighted(token_loss, is_weights, valid)
    token_loss = torch.where(valid, token_loss, 0.0)
    abs_kl = log_ratio.detach().abs()
    n = max(int(valid.sum()), 1)
    metrics = {
        "kl_cov_frac": float(selected.sum()) / n,
        "ppo_kl": masked_mean(abs_kl, valid),  # |d|, as verl reports it for KL-Cov
        "kl_selected": masked_mean(abs_kl, selected),
        **clip_metrics,
        **cov_metrics(token_covariance(lp, adv, valid, cov_means), valid, selected),
        **quota_metrics(ratio, int(valid.sum()), selected),
    }
    return LossOutput(aggregate(token_loss, valid, agg, normalizer, dp_size), token_loss, selected, metrics)


# --------------------------------------------------------------------------- the objective, registered


@dataclass
class KLCovConfig:
    ratio: float = option(
        2e-3, "fraction of valid tokens with the KL penalty: 2e-3 for 7B, 2e-4 for 32B (a fraction, not %)"
    )
    coef: float = option(1.0, "beta, the penalty coefficient on |logp - old_logp| (paper: 1)")
    ppo_clip: bool = option(
        False, "ablation, not the paper's KL-Cov: the base loss takes PPO's clipped surrogate (--loss.clip_low/high) "
        "instead of the unclipped -A*rho, separating the penalty's effect from the missing clip",
    )  # fmt: skip
    within: str = option(
        "", "choose only among the tokens another selector picks: '' (all) | high_entropy (the top "
        "--loss.high_entropy.top_frac by entropy); the quota still counts every valid token",
    )  # fmt: skip


def select(batch: TokenBatch, params: KLCovConfig, ctx: LossContext, candidates: torch.Tensor | None):
    return kl_cov_select(
        batch.log_probs, batch.advantages, batch.mask, ratio=params.ratio, cov_means=ctx.cov_means,
        candidates=live_candidates(batch.mask, batch.is_weights, candidates),
    )  # fmt: skip


def validate(params: KLCovConfig, cfg) -> list[str]:
    errors = []
    if not 0 < params.ratio <= 1:
        errors.append(f"--loss.kl_cov.ratio: {params.ratio} must be a fraction in (0, 1]; 2e-3 means 0.2 % of tokens")
    if params.coef < 0:
        errors.append("--loss.kl_cov.coef: must be >= 0")
    return errors


def notes(params: KLCovConfig, cfg) -> list[str]:
    # under --offpolicy.bypass pi_old is the rollout's log-probs, which differ from the trainer's (async lag,
    # vLLM's numerics): |logp - old_logp| is not 0 at the first step, so the penalty acts there too
    if cfg.train.optimizer_steps_per_step == 1 and not cfg.offpolicy.uses_bypass():
        return [
            "KL-Cov with one optimizer step per rollout batch acts as plain policy gradient: on-policy, "
            "|logp - old_logp| = 0, so the penalty has no gradient. Use --train.mini_batches > 1 (the paper: 8)."
        ]
    return []


def run_note(params: KLCovConfig, metrics: dict[str, float]) -> str:
    """KL-Cov at its floor is not starved: the one token a micro-batch always gets is more than the ratio asks for
    (1.25% of ~80 tokens against 0.2%). Says what is true: the ratio does not set the selection at this size."""
    tokens = metrics.get("loss/select_tokens", 0.0)
    return (
        f"[entropy-openrlhf] kl_cov selects by its floor, not its ratio: for several steps every micro-batch's "
        f"quota max(1, floor({params.ratio:g} x ~{tokens:.0f} tokens)) was one token, so the penalty acted on "
        f"{metrics.get('loss/kl_cov_frac', 0.0):.2%} of tokens, more than the {params.ratio:.2%} the ratio asks for "
        f"(cov p99 {metrics.get('cov/p99', 0.0):.3g}). The ratio sets the selection from about "
        f"{1 / params.ratio:.0f} tokens per selection: larger micro-batches (--actor.micro_batch_size) or one "
        "selection over the mini-batch (--loss.scope global); docs/algorithms/losses.md, 'At small scale'."
    )


@register_objective(
    "kl_cov", KLCovConfig, select=select, knobs=(Knob("coef"), Knob("ratio", cap=1.0)), validate=validate,
    notes=notes, run_note=run_note,
    summary="KL-Cov: policy gradient plus an L1 pull to the old policy on top-covariance tokens",
)  # fmt: skip
def kl_cov(batch: TokenBatch, params: KLCovConfig, ctx: LossContext) -> LossOutput:
    return kl_cov_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, ratio=params.ratio, coef=params.coef,
        ppo_clip=(ctx.clip_low, ctx.clip_high) if params.ppo_clip else None, selected=ctx.selected,
        cov_means=ctx.cov_means, agg=ctx.agg, normalizer=ctx.normalizer, dp_size=ctx.dp_size,
        is_weights=batch.is_weights,
    )  # fmt: skip
