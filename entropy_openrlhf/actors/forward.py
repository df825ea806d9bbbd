"""Turning samples into padded tensors and a causal LM forward into per-token log-probs (policy and reference).

A sequence is prompt + response, right-padded. Log-probs live on the shifted grid (B, T-1): position j holds the
log-prob of token j+1 given tokens 0..j, so the response tokens of a sequence with prompt length P and response
length R sit at positions P-1 .. P+R-2, which `mask` marks. All per-token inputs of the losses use this grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from entropy_openrlhf.actors.chunked_head import HEAD_CHUNK_ATTR, head_log_probs, last_hidden_states
from entropy_openrlhf.actors.prefix_packing import ATTENTION_NAME, MODES, PackedBatch, choose_packing, register
from entropy_openrlhf.algorithms.metrics import token_entropy, token_entropy_with_grad
from entropy_openrlhf.compat import ensure_flash_attn_importable

ensure_flash_attn_importable()
from openrlhf.models.utils import log_probs_from_logits  # noqa: E402  (needs the flash-attn stand-in first)


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T-1) float, 1 on response tokens
    packed: PackedBatch | None = None  # the layout the forward runs on, when the model shares prefixes

    def to(self, device) -> SeqBatch:
        packed = self.packed.to(device) if self.packed is not None else None
        return SeqBatch(self.input_ids.to(device), self.attention_mask.to(device), self.mask.to(device), packed)


def use_shared_prefix(model, mode: str) -> bool:
    """`--train.shared_prefix`: with auto or on, switch the model's attention to the packed one (every batch then
    needs a layout: make_seq_batch with the same mode gives it one). Returns whether it did."""
    if mode not in MODES:
        raise ValueError(f"shared_prefix {mode!r}: auto | on | off")
    if mode == "off":
        return False
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return True


def make_seq_batch(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    *,
    shared_prefix: str = "off",
    model_config=None,
) -> SeqBatch:
    """The right-padded batch. With `shared_prefix` auto or on (the model's attention switched by
    use_shared_prefix), also its packed layout, chosen with the model's sizes from `model_config`."""
    batch = _plain_batch(prompt_ids, response_ids, pad_id)
    if shared_prefix != "off":
        hidden = getattr(model_config, "hidden_size", 1024)
        ffn = getattr(model_config, "intermediate_size", 4 * hidden)
        batch.packed = choose_packing(shared_prefix, prompt_ids, response_ids, pad_id, hidden, ffn)
    return batch


def _plain_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> SeqBatch:
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
    model, batch: SeqBatch, *, temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T-1) log-probs of the actual next tokens (grad flows if enabled), and optionally their entropies.
    Both are 0 on the positions before the batch's first response token, and, for a packed batch, wherever `mask`
    is 0. A batch with a packed layout runs on its packed rows, and the results land in this same grid.
    The entropies are detached unless `entropy_grad` (the entropy bonus), which implies `with_entropy`."""
    with_entropy = with_entropy or entropy_grad
    chunk = getattr(model, HEAD_CHUNK_ATTR, 0)
    if chunk:
        return _chunked_log_probs(model, batch, chunk, temperature, with_entropy, entropy_grad)
    if batch.packed is not None:
        return _packed_log_probs(
            model, batch, batch.packed, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
        )
    # The vocabulary projection and softmax run only from the first response position on: prompts are most of a
    # sequence, and their logits would cost about 30% of a forward and backward (measured on SmolLM2, CPU).
    start = int(batch.mask.any(dim=0).float().argmax())  # 0 when no response has a token: the full grid
    T = batch.input_ids.shape[1]
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=max(T - start, 1)
    ).logits[:, -(T - start) :][:, :-1]
    wide = _at_temperature(logits, temperature)
    kept = log_probs_from_logits(wide, batch.input_ids[:, start + 1 :])
    log_probs = kept.new_zeros(batch.mask.shape)
    log_probs[:, start:] = kept
    entropy = None
    if with_entropy:
        entropy = log_probs.new_zeros(batch.mask.shape)
        # with grad: on the same tensor the log-probs' graph keeps, so the entropy's backward keeps no copy of it
        entropy[:, start:] = token_entropy_with_grad(wide) if entropy_grad else token_entropy(wide)
    return log_probs, entropy


def _at_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits the log-softmax sees: half precision widened to fp32 (fp32 and fp64 stay as they are: fp64 tests
    compare exactly), then divided by the sampling temperature, in that order, as vLLM's sampler does; dividing in
    bf16 first would round z / T to 8 bits and move a token's log-prob by up to ~0.1 nats at T = 0.7 (32k vocab).
    fp32 logits also take OpenRLHF's chunked logsumexp path, half-precision ones its slower row loop."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        wide = logits.float()
        # in place on the fresh copy: no second (tokens x vocabulary) fp32 tensor (the copy's backward keeps nothing)
        return wide.div_(temperature) if temperature != 1.0 else wide
    return logits / temperature if temperature != 1.0 else logits


def _packed_log_probs(
    model, batch: SeqBatch, packed: PackedBatch, *, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # logits only from the first position that predicts a response token (all of them when none is left unmasked)
    start = int(packed.source_pos.min()) if len(packed.source_pos) else 0
    width = packed.input_ids.shape[1]
    logits = model(
        input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=width - start,
        prefix_layout=packed.rows,
    ).logits  # fmt: skip
    picked = logits[packed.source_row, packed.source_pos - start]  # (N, V): one row per response token, grid order
    valid = batch.mask.bool()
    targets = batch.input_ids[:, 1:][valid]  # the same row-major order of the grid's valid cells
    wide = _at_temperature(picked, temperature)
    kept = log_probs_from_logits(wide[None], targets[None])[0]
    log_probs = kept.new_zeros(batch.mask.shape)
    log_probs[valid] = kept
    entropy = None
    if with_entropy:
        entropy = log_probs.new_zeros(batch.mask.shape)  # the grid's dtype, as the plain path gives it
        values = token_entropy_with_grad(wide) if entropy_grad else token_entropy(wide)
        entropy[valid] = values.to(entropy.dtype)
    return log_probs, entropy


def _chunked_log_probs(
    model, batch: SeqBatch, chunk: int, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """forward_log_probs with the head in chunks (chunked_head.py): the decoder's last hidden states of the
    positions that predict a response token, in the plain or the packed layout, then the head on those alone."""
    valid = batch.mask.bool()
    if batch.packed is not None:
        p = batch.packed
        hidden = last_hidden_states(model, input_ids=p.input_ids, position_ids=p.position_ids, prefix_layout=p.rows)
        rows = hidden[p.source_row, p.source_pos]  # (N, H): one row per response token, in the grid's order
    else:
        hidden = last_hidden_states(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        rows = hidden[:, :-1][valid]
    kept, values = head_log_probs(
        model, rows, batch.input_ids[:, 1:][valid], chunk=chunk, temperature=temperature, entropy_grad=entropy_grad
    )
    log_probs = kept.new_zeros(batch.mask.shape)
    log_probs[valid] = kept
    entropy = None
    if with_entropy:
        entropy = log_probs.new_zeros(batch.mask.shape)
        entropy[valid] = values
    return log_probs, entropy


def log_probs_by_micro_batch(
    model,
    make_batch: Callable[[list[list[int]], list[list[int]]], SeqBatch],
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    sizes: list[int],
    *,
    temperature: float,
    pad_id: int,
) -> list[list[float]]:
    """A forward-only pass (the reference's): one list of per-token log-probs per response, in order, from
    micro-batches of `sizes` sequences. A size of 0 is a stand-in forward of one pad token, run because under
    ZeRO-3 the other ranks' forwards gather parameters with this rank too, so every rank must run as many."""
    if sum(sizes) != len(prompt_ids):
        raise ValueError(f"micro-batches {sizes} for {len(prompt_ids)} sequences")
    out: list[list[float]] = []
    start = 0
    with torch.no_grad():
        for n in sizes:
            if n == 0:
                forward_log_probs(model, make_batch([[pad_id]], [[pad_id]]))
                continue
            b = make_batch(prompt_ids[start : start + n], response_ids[start : start + n])
            lp, _ = forward_log_probs(model, b, temperature=temperature)
            out += [lp[j][b.mask[j].bool()].float().tolist() for j in range(lp.shape[0])]
            start += n
    return out
