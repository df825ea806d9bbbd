"""Entropy and covariance telemetry. Every metric these produce is defined in docs/metrics.md."""

from __future__ import annotations

import torch


def token_entropy(logits: torch.Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: logsumexp(z) - sum softmax(z) * z.

    logits: (..., V) in any dtype. Rows are processed `chunk_size` at a time in fp32, so peak extra memory is
    chunk_size x V floats instead of a full fp32 copy of (B, L, V). Returns (...) fp32, no grad.
    """
    shape = logits.shape[:-1]
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        out[start : start + chunk_size] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return out.reshape(shape)


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """token_mean: over all valid tokens (verl's actor/entropy); seq_mean: mean over responses of each response's
    token mean (the paper's and the authors' fork's train_entropy)."""
    valid = mask.bool()
    n = int(valid.sum())
    if n == 0:
        return {"token_mean": 0.0, "seq_mean": 0.0}
    ent = torch.where(valid, entropy.float(), 0.0)
    lengths = valid.sum(-1)
    nonempty = lengths > 0
    seq_means = ent.sum(-1)[nonempty] / lengths[nonempty]
    return {"token_mean": float(ent.sum() / n), "seq_mean": float(seq_means.mean())}


def covariance_stats(log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token covariances c = (A - mean A)(logp - mean logp) over the valid tokens, and the batch estimate of
    Cov(log pi, A) (their mean), whose sign drives entropy: positive means entropy falls (docs/losses.md, 'Why the
    covariance')."""
    valid = mask.bool()
    lp = log_probs.detach().float()[valid]
    adv = advantages.detach().float()[valid]
    if lp.numel() == 0:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0, "min": 0.0, "frac_positive": 0.0}
    cov = (adv - adv.mean()) * (lp - lp.mean())
    return {
        "mean": float(cov.mean()),
        "p99": float(torch.quantile(cov, 0.99)),
        "max": float(cov.max()),
        "min": float(cov.min()),
        "frac_positive": float((cov > 0).float().mean()),
    }
