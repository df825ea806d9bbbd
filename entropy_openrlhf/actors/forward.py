"""Turning samples into padded tensors and a causal LM forward into per-token log-probs (policy and reference).

A sequence is prompt + response, right-padded. Log-probs live on the shifted grid (B, T-1): position j holds the
log-prob of token j+1 given tokens 0..j, so the response tokens of a sequence with prompt length P and response
length R sit at positions P-1 .. P+R-2, which `mask` marks. All per-token inputs of the losses use this grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.metrics import token_entropy
from entropy_openrlhf.compat import ensure_flash_attn_importable

ensure_flash_attn_importable()
from openrlhf.models.utils import log_probs_from_logits  # noqa: E402  (needs the flash-attn stand-in first)


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T-1) float, 1 on response tokens

    def to(self, device) -> SeqBatch:
        return SeqBatch(self.input_ids.to(device), self.attention_mask.to(device), self.mask.to(device))


def make_seq_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> SeqBatch:
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    T = max(lengths)
    B = len(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T - 1)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention[i, : len(p) + len(r)] = 1
        mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1.0
    return SeqBatch(input_ids, attention, mask)


def to_token_grid(values: list[list[float]], batch: SeqBatch, prompt_lens: list[int]) -> torch.Tensor:
    """Place per-response-token values (e.g. rollout log-probs) onto the (B, T-1) grid."""
    out = torch.zeros_like(batch.mask)
    for i, (vals, p) in enumerate(zip(values, prompt_lens, strict=True)):
        if vals:
            out[i, p - 1 : p - 1 + len(vals)] = torch.tensor(vals, dtype=out.dtype)
    return out


def forward_log_probs(
    model, batch: SeqBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T-1) log-probs of the actual next tokens (grad flows if enabled), and optionally their entropies.
    Both are 0 on the positions before the batch's first response token."""
    # The vocabulary projection and softmax run only from the first response position on: prompts are most of a
    # sequence, and their logits would cost about 30% of a forward and backward (measured on SmolLM2, CPU).
    start = int(batch.mask.any(dim=0).float().argmax())  # 0 when no response has a token: the full grid
    T = batch.input_ids.shape[1]
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=max(T - start, 1)
    ).logits[:, -(T - start) :][:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    # fp32 logits take OpenRLHF's chunked logsumexp path; half-precision ones its row loop
    kept = log_probs_from_logits(logits.float(), batch.input_ids[:, start + 1 :])
    log_probs = kept.new_zeros(batch.mask.shape)
    log_probs[:, start:] = kept
    entropy = None
    if with_entropy:
        entropy = log_probs.new_zeros(batch.mask.shape)
        entropy[:, start:] = token_entropy(logits)
    return log_probs, entropy
