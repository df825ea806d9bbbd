"""Entropy and covariance telemetry. Every metric these produce is defined in docs/guides/metrics.md."""

from __future__ import annotations

import numpy as np
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


class _ChunkedEntropy(torch.autograd.Function):
    """H(z) = logsumexp(z) - sum softmax(z) * z per row, with its gradient dH/dz_j = -p_j (z_j - E_p[z]).

    Why a Function of its own: autograd through `softmax` and `p * z` would keep p, and for half-precision logits an
    fp32 copy of z, for every token until the backward (8-12 bytes per vocabulary entry per token). This keeps only
    the logits it is given (the log-prob path keeps the same tensor already) and the (N,) entropies, and recomputes
    p chunk by chunk in the backward, so its extra working memory is chunk_size x V floats whatever the length.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=_math_dtype(logits), device=logits.device)
        for start in range(0, flat.shape[0], chunk_size):
            z = flat[start : start + chunk_size].to(out.dtype)
            out[start : start + chunk_size] = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, out)
        ctx.chunk_size = chunk_size
        return out.reshape(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, entropy = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(-1).to(entropy.dtype)
        # one gradient of the logits' size: the same as the log-prob path's own gradient of them, which autograd
        # adds this one into
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_size):
            stop = start + ctx.chunk_size
            z = flat[start:stop].to(entropy.dtype)
            p = torch.softmax(z, dim=-1)
            # E_p[z] = logsumexp(z) - H, from the saved entropy: no second reduction over the vocabulary
            expected = torch.logsumexp(z, dim=-1) - entropy[start:stop]
            row_grad = -g[start:stop, None] * p * (z - expected[:, None])
            # a row the loss does not use (padding: upstream gradient 0) gives exactly 0, even where its logits are
            # garbage and p is NaN (0 x NaN would be NaN and reach the weights)
            grad[start:stop] = torch.where(g[start:stop, None] == 0, 0.0, row_grad).to(grad.dtype)
        return grad.reshape(logits.shape), None


def _math_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision logits; fp32 and fp64 as they are (the fp64 tests compare to a hand computation)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def token_entropy_with_grad(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """`token_entropy` that carries its gradient to the logits (the entropy bonus, `--loss.entropy_coef`).

    logits: (..., V), already divided by the sampling temperature. Returns (...) in fp32 (fp64 for fp64 logits).
    Memory: nothing kept for the backward beyond the logits themselves and one float per row; the backward builds
    one gradient of the logits' shape (4 V bytes per token in fp32: 0.6 MB at Qwen2.5's 152k vocabulary) plus
    chunk_size x V floats of working memory, rows processed `chunk_size` at a time in both passes.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size} must be >= 1")
    return _ChunkedEntropy.apply(logits, chunk_size)


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


def turn_entropy_stats(
    entropy: torch.Tensor, mask: torch.Tensor, turns: torch.Tensor, post_tool_tokens: int
) -> dict[str, float]:
    """Entropy per turn of tool episodes: `entropy/turn1/seq_mean`, `turn2`, `turn3+` (entropy_stats' seq_mean over
    the valid tokens of that turn, each response that has some counting once), and `entropy/post_tool_token_mean`,
    the token mean over the first `post_tool_tokens` policy tokens of every turn after a tool output. `turns`: each
    token's turn (1, 2, ...; 0 on tool tokens), shaped like `mask`. A key is absent where no valid token has it (not
    a 0: a micro-batch without a second turn says nothing of second turns)."""
    valid = mask.bool()
    out = {}
    for name, chosen in (("turn1", turns == 1), ("turn2", turns == 2), ("turn3+", turns >= 3)):
        keep = valid & chosen
        if keep.any():
            out[f"entropy/{name}/seq_mean"] = entropy_stats(entropy, keep)["seq_mean"]
    # each token's position within its turn: its index less the index where the run of its turn id began
    index = torch.arange(turns.shape[-1], device=turns.device).expand_as(turns)
    starts = torch.ones_like(valid)
    starts[..., 1:] = turns[..., 1:] != turns[..., :-1]
    position = index - torch.where(starts, index, 0).cummax(-1).values
    post = valid & (turns >= 2) & (position < post_tool_tokens)
    if post.any():
        out["entropy/post_tool_token_mean"] = float(entropy.float()[post].mean())
    return out


def covariance_stats(log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token covariances c = (A - mean A)(logp - mean logp) over the valid tokens, and the batch estimate of
    Cov(log pi, A) (their mean), whose sign drives entropy: positive means entropy falls (docs/algorithms/losses.md,
    'Why the
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


# --------------------------------------------------------------------------- evaluation: pass@k, majority vote


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for one prompt with `n` sampled responses of which `c` are correct: the
    chance that k responses drawn without replacement from the n include a correct one, 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), the same quantity without binomials, so it stays exact to float
    precision for n in the thousands (C(n, k) alone overflows a float near n = 1030, k = n/2)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"pass_at_k: {name} must be an int, got {value!r}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n] = [1, {n}], got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c (correct responses) must be in [0, n] = [0, {n}], got {c}")
    if n - c < k:
        return 1.0  # every draw of k responses includes a correct one
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k_ladder(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """maj@n for one prompt: whether the answer given most often (ties: the one given first) was judged correct.
    Responses without an extracted answer (None or "") do not vote; with no vote at all the prompt counts wrong."""
    counts: dict[str, int] = {}
    verdict: dict[str, bool] = {}
    for answer, ok in zip(answers, correct):
        if not answer:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        verdict.setdefault(answer, ok)  # one string, one label: the verifier's verdict is the same for each copy
    if not counts:
        return False
    top = max(counts.values())
    winner = next(a for a in counts if counts[a] == top)  # dicts keep insertion order: the first one given
    return verdict[winner]


def bootstrap_interval(
    per_prompt: list[list[float]], *, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile interval of the mean over groups of per-prompt values, resampling prompts with replacement
    within each group (one group per data source; the statistic is the mean of the groups' means, as the
    averaged eval metrics are). Prompts, not responses, are the unit: a prompt's n responses are not independent."""
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for values in per_prompt:
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            raise ValueError("bootstrap_interval: a group has no prompts")
        picks = rng.integers(0, v.size, size=(resamples, v.size))
        means += v[picks].mean(axis=1)
    means /= len(per_prompt)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
