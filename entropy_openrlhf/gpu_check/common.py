"""What every check shares: the checks' names, the tolerances per working dtype, a check's result and its
context, and the sampled batch the forward checks score."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

CHECKS = ("cuda", "forward", "objectives", "entropy", "zero2", "zero3", "head-chunk", "off-policy", "imports")
WIDER = {torch.bfloat16: torch.float32, torch.float32: torch.float64}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class Tolerances:
    """What each comparison allows, in the working dtype. Log-probs in nats, over the response tokens."""

    wide_mean: float  # mean |log-prob - the wider dtype's|
    wide_max: float  # max of the same
    packed_mean: float  # mean |packed - plain|, both in the working dtype
    packed_max: float
    exact_max: float  # max |packed - plain| one precision wider, where packing is exact up to rounding
    rel: float  # losses, gradients, entropies, weights and metrics computed in fp32 on the device against fp64
    # a training step's gradient norm and loss with the output head in chunks against whole: the same math on other
    # matrix shapes, whose kernels may round the working dtype's logits differently
    step_rel: float


TOLERANCES = {
    # fp32 against fp64: rounding alone. Measured on CPU, mean/max: the tiny model 2e-7/7e-7, SmolLM2 2.5e-6/2.3e-5
    # (packed against plain in fp32 the same; in fp64 they agreed exactly)
    torch.float32: Tolerances(
        wide_mean=1e-5, wide_max=1e-4, packed_mean=1e-5, packed_max=1e-4, exact_max=1e-9, rel=1e-4, step_rel=1e-4
    ),
    # bf16 weights and activations against fp32: 8 bits of mantissa, per-token errors of a few hundredths that
    # accumulate over the layers. SmolLM2 in bf16 on a CPU with bf16 support (AMD EPYC, AVX-512 BF16) gave mean/max
    # 0.028/0.18 nats against fp32, packed 0.03/0.36, packed against plain 0.034/0.33; the bounds leave GPU kernels
    # about 3x that. A layout bug that bf16's noise could hide shows in exact_max, the same forward in fp32 (GPU
    # fp32 matmuls and SDPA stay fp32 unless TF32 is switched on, which nothing here does).
    # bf16 logits from a chunk's matrix product may differ from the whole grid's by one unit in the last place (2^-8
    # relative) where the kernels accumulate in another order: log-probs by up to a few hundredths, the step's
    # gradient norm and the loss after it by well under 1e-2
    torch.bfloat16: Tolerances(
        wide_mean=0.1, wide_max=2.0, packed_mean=0.1, packed_max=2.0, exact_max=1e-4, rel=1e-4, step_rel=1e-2
    ),
}

# The objectives' settings for the check: quotas large enough to select many of its 120 tokens, Clip-Cov's bounds
# where this batch's covariances lie (as tests/unit/test_objectives_through_registry.py does)
OBJECTIVE_SETTINGS: dict[str, dict[str, Any]] = {
    "clip_cov": {"ratio": 0.2, "lb": 0.5, "ub": 2.0},
    "kl_cov": {"ratio": 0.15},
    "high_entropy": {"top_frac": 0.3},
}
PLANT = 0.5  # what --plant adds to the checked value of one check, so that the test sees it fail


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name:<10}  {self.detail} ({self.seconds:.1f} s)"


@dataclass
class Context:
    """What every check is given."""

    device: torch.device
    dtype: torch.dtype  # the working dtype
    model_path: str
    model_name: str  # tiny, smollm2 or the folder
    plant: str  # the check whose value --plant perturbs ("" = none)
    seed: int = 0

    def planted(self, name: str, x: Any) -> Any:
        """`x` with PLANT added when --plant names this check: the comparison after it must then fail."""
        return x + PLANT if self.plant == name else x


# ------------------------------------------------------------------ helpers


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(|want|, 1e-12): one relative error for a whole tensor, in fp64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12)) if want.numel() else 0.0


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model.to(device).eval()


def sampled_batch(
    model: torch.nn.Module, path: str, device: torch.device, n_prompts: int = 3, n_samples: int = 4, seed: int = 0
) -> tuple[list[list[int]], list[list[int]], int]:
    """Chat prompts, each repeated n_samples times in consecutive rows (as a GRPO batch is, so packing shares them),
    with responses sampled from `model`: the tokens a policy would score. Returns prompts, responses, pad id."""
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts, responses = [], []
    torch.manual_seed(seed)
    for q in ("What is 17 + 25?", "Tom has 4 apples and gets 9 more. How many now?", "Name a prime above 10.")[
        :n_prompts
    ]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, max_new_tokens=24, min_new_tokens=6,
                num_return_sequences=n_samples, pad_token_id=pad, use_cache=True,
            )  # fmt: skip
        for row in out[:, len(ids) :].tolist():
            eos = tok.eos_token_id
            cut = row.index(eos) + 1 if eos in row else len(row)  # up to the first end of turn, as vLLM stops
            prompts.append(ids)
            responses.append(row[:cut])
    return prompts, responses, pad
