"""The output head in chunks (`--train.head_chunk_tokens N`): log-probs and entropies of the response tokens from the
decoder's last hidden states, N tokens at a time, so that no forward or backward holds more than N tokens' logits.

With the whole head a micro-batch's logits over the vocabulary are materialised at once, with their fp32 copy and
their gradient: about 1.8 MiB per token at Qwen's 152k vocabulary (docs/guides/long_responses.md). Here an autograd
Function computes each chunk's logits, keeps only the log-probs and entropies, and in the backward computes each chunk's
logits again to form its gradient; its working memory is two or three (chunk x vocabulary) tensors in fp32. This
follows verl's pure-PyTorch fallback for its fused kernels (verl/utils/experimental/torch_functional.py,
FusedLinearForPPO), with two differences:
- the Function runs inside the head module's own forward (`head_log_probs` swaps the module's forward for the
  call), so DeepSpeed ZeRO-3 gathers the head's weight once for the forward and once for the backward, from its hooks
  on that module, as for the whole head, and every rank calls the module once per forward whatever its tokens (the
  gathers are collectives: a count that differed between ranks would pair one rank's gather with another's);
- the family's own post-processing of its logits (Granite's scaling, Gemma's soft-capping) and the sampling
  temperature are applied as the whole-head path applies them, so the numbers are the same up to rounding.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The model attribute use_chunked_head sets: the response tokens per chunk of the head (0 = the whole head)
HEAD_CHUNK_ATTR = "head_chunk_tokens"
# Families whose logits are the output embedding of the decoder's last hidden state, then at most what HeadPost
# applies; each is tested chunked against whole (tests/unit/test_chunked_head.py)
CHUNKED_HEAD_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "granite")


def use_chunked_head(model, tokens: int) -> bool:
    """`--train.head_chunk_tokens`: the head in chunks of `tokens` response tokens (0: the whole head, also where it
    was chunked). Set on the model before DeepSpeed or peft wrap it (both pass attribute reads through). Returns
    whether it is on."""
    if tokens < 0:
        raise ValueError(f"--train.head_chunk_tokens {tokens} must be >= 0 (0 = off)")
    if tokens > 0 and model.config.model_type not in CHUNKED_HEAD_FAMILIES:
        raise ValueError(
            f"--train.head_chunk_tokens {tokens}: model type {model.config.model_type!r} is not one whose output head "
            f"is known here ({', '.join(CHUNKED_HEAD_FAMILIES)}); use --train.head_chunk_tokens 0"
        )
    setattr(model, HEAD_CHUNK_ATTR, tokens)
    return tokens > 0


def causal_lm(model):
    """The transformers CausalLM inside a DeepSpeed engine and/or a peft model."""
    model = getattr(model, "module", model)  # DeepSpeedEngine
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


def last_hidden_states(model, **inputs) -> torch.Tensor:
    """(rows, T, H): the decoder's output (after its final norm) for `inputs`, through the model's own forward (so
    DeepSpeed's and peft's wrappers run as for the logits), which is asked for its last position's logits only."""
    captured: list[torch.Tensor] = []

    def keep(module, args, output) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = causal_lm(model).get_decoder().register_forward_hook(keep)
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[-1]


@dataclass(frozen=True)
class HeadPost:
    """What turns the head's output z into the logits the log-softmax sees: the family's scaling (Granite) and
    soft-capping (Gemma 2 and 3) in z's dtype, as the model's own head applies them, then the sampling temperature
    in the log-softmax's dtype, as the whole-head path (forward.py) and vLLM's sampler divide."""

    scaling: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @classmethod
    def of(cls, config, temperature: float) -> HeadPost:
        scaling = getattr(config, "logits_scaling", None)
        return cls(float(scaling) if scaling else 1.0, getattr(config, "final_logit_softcapping", None) or None,
                   float(temperature))  # fmt: skip

    def logits(self, z: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
        if self.scaling != 1.0:
            z = z / self.scaling
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        z = z.to(wide)
        if self.temperature != 1.0:
            z = z / self.temperature
        return z

    def slope(self, z: torch.Tensor, wide: torch.dtype) -> torch.Tensor | float:
        """d logits / d z, elementwise (a number where it is the same everywhere)."""
        factor = 1.0 / (self.scaling * self.temperature)
        if not self.softcap:
            return factor
        t = torch.tanh(z.to(wide) / (self.scaling * self.softcap))
        return (1.0 - t * t) * factor


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The log-softmax's dtype: fp32 for half precision (the whole-head path's), fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_j a_ij b_ij per row, as a batched matrix product: no (rows x vocabulary) product is materialised."""
    return torch.bmm(a[:, None, :], b[:, :, None])[:, 0, 0]


class _ChunkedHead(torch.autograd.Function):
    """(log-probs of `targets`, entropies) of the rows of `hidden` under logits post(hidden @ weight.T + bias),
    `chunk` rows at a time in both passes. Saved for the backward: the inputs only."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, post: HeadPost, chunk: int, entropy_grad: bool):
        wide = _wide(hidden.dtype)
        n = hidden.shape[0]
        log_probs = torch.empty(n, dtype=wide, device=hidden.device)
        entropy = torch.empty(n, dtype=wide, device=hidden.device)
        for i in range(0, n, chunk):
            logits = post.logits(F.linear(hidden[i : i + chunk], weight, bias), wide)
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            log_probs[i : i + chunk] = logp.gather(-1, targets[i : i + chunk, None])[:, 0]
            entropy[i : i + chunk] = -_rowwise_dot(logp.exp(), logp)
            del logp
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.post, ctx.chunk = post, chunk
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        post, chunk = ctx.post, ctx.chunk
        wide = _wide(hidden.dtype)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        d_hidden = torch.zeros_like(hidden) if want_h else None
        # summed over the chunks in fp32 (16 bf16 partial sums at 16k tokens in chunks of 1024 would lose about 2%)
        d_weight = torch.zeros_like(weight, dtype=wide) if want_w else None
        d_bias = torch.zeros_like(bias) if want_b else None
        # Each chunk's (rows x vocabulary) work is done in place where it can be: at most two such tensors in the
        # working precision are alive at once (three with soft-capping, whose slope depends on z)
        for i in range(0, hidden.shape[0], chunk):
            h, t = hidden[i : i + chunk], targets[i : i + chunk, None]
            z = F.linear(h, weight, bias)
            z_dtype, slope = z.dtype, post.slope(z, wide)
            logp = torch.log_softmax(post.logits(z, wide), dim=-1)
            del z
            p = logp.exp()
            # d lp_t / d l = onehot(t) - p and d H / d l = -p (log p + H), so with c = g_lp + g_ent (log p + H):
            # d l = -p c + g_lp onehot(t)
            if g_ent is not None:
                entropy = -_rowwise_dot(p, logp)[:, None]
                coef = logp.add_(entropy).mul_(g_ent[i : i + chunk, None].to(wide))
                if g_lp is not None:
                    coef.add_(g_lp[i : i + chunk, None].to(wide))
            else:
                coef = g_lp[i : i + chunk, None].to(wide)
            del logp
            d_logits = p.mul_(coef).neg_()
            del coef
            if g_lp is not None:
                d_logits.scatter_add_(-1, t, g_lp[i : i + chunk, None].to(wide))
            if not (isinstance(slope, float) and slope == 1.0):
                d_logits.mul_(slope)
            d_z = d_logits.to(z_dtype)
            del d_logits, slope
            if want_h:
                d_hidden[i : i + chunk] = d_z @ weight
            if want_w:
                d_weight += (d_z.t() @ h).to(wide)
            if want_b:
                d_bias += d_z.sum(0)
        if want_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None


def head_log_probs(
    model,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int,
    temperature: float,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` (N,) and entropies (N,) from last hidden states (N, H), through one call of the model's
    head module whose forward is, for that call, the chunked Function. The entropies carry a gradient only with
    `entropy_grad`."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"--train.head_chunk_tokens: the output head is a {type(head).__name__}, not a plain Linear (an adapter "
            "on it?); use --train.head_chunk_tokens 0"
        )
    post = HeadPost.of(lm.config, temperature)

    def chunked_forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _ChunkedHead.apply(rows, self.weight, self.bias, targets, post, chunk, entropy_grad)

    head.forward = types.MethodType(chunked_forward, head)  # the instance's, for this call; its class's stays
    try:
        return head(hidden)
    finally:
        del head.forward
