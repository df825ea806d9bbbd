"""LoRA on the policy (`--actor.lora_rank r`): the base model frozen, low-rank adapters trained (peft).

Three views of one adapted model serve the rest of the trainer:
- training: the peft model DeepSpeed wraps; only the adapters' parameters reach the optimizer;
- the weights the engines and a saved HF folder need: `named_weights`, each base weight with its adapter's update
  added (W + alpha / r * B A, peft's own `get_delta_weight`), under the base model's own names, computed one layer
  at a time and never written into the training weights (merging in place and back would drift them by rounding);
- the reference: the same model with the adapter switched off (`adapter_off`), so no second model is loaded (as
  verl does).

Actor-only: imported by the policy ranks (policy_engine.py, policy_actor.py), not by the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from entropy_openrlhf.config import Config

ADAPTER = "default"  # peft's name for the one adapter a model gets
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's parameter names


def apply_lora(model: torch.nn.Module, cfg: Config) -> PeftModel:
    """The model with adapters on `--actor.lora_target_modules`, only their parameters trainable."""
    a = cfg.actor
    targets = a.lora_target_modules.strip()
    config = LoraConfig(
        r=a.lora_rank,
        lora_alpha=a.lora_alpha,
        lora_dropout=a.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        bias="none",
        task_type="CAUSAL_LM",
    )
    # the adapters drawn from the run's seed (A random, B zero): every rank and a resumed or repeated run start from
    # the same, and tests can build them outside the actor; the global generator is left as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        peft_model = get_peft_model(model, config)
    if a.gradient_checkpointing:
        # the frozen embedding gives checkpointed segments inputs without grad, and reentrant checkpointing would then
        # drop the adapters' gradients: make the embedding's output require grad
        peft_model.enable_input_require_grads()
    return peft_model


def base_name(peft_name: str) -> str:
    """A parameter's name in the base model: `base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def is_adapter_param(peft_name: str) -> bool:
    return ".lora_" in peft_name


def named_weights(
    model: torch.nn.Module, gathered: Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the engines serve and a saved HF folder holds: (base name, tensor) for every base parameter, in
    named_parameters order; under LoRA each adapted weight with its adapter's update added (W + alpha / r * B A, by
    peft's `get_delta_weight`), computed here and never written into the training weights; without LoRA the
    parameters themselves. A tensor is valid until the next one is asked for. `gathered(params)` holds the whole of
    `params` (ZeRO-3's gather: every rank must iterate, in the same order)."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue
        owner = modules.get(name.rsplit(".base_layer.", 1)[0]) if ".base_layer." in name else None
        if isinstance(owner, LoraLayer) and name.endswith(".weight") and ADAPTER in owner.lora_A:
            adapter = [owner.lora_A[ADAPTER].weight, owner.lora_B[ADAPTER].weight]
            with gathered([param, *adapter]):
                delta = owner.get_delta_weight(ADAPTER)
                yield base_name(name), (param.data.float() + delta.float()).to(param.dtype)
        else:
            with gathered([param]):
                yield base_name(name), param.data


def weight_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(base name, parameter) of what `named_weights` yields, in its order: the names, dtypes and shapes a sync
    announces before it sends."""
    return [(base_name(n), p) for n, p in model.named_parameters() if not is_adapter_param(n)]


def adapter_off(model: torch.nn.Module) -> AbstractContextManager[Any]:
    """The base model's forward: the adapter switched off for the block (a no-op context without LoRA)."""
    if isinstance(model, PeftModel):
        return model.disable_adapter()
    return contextlib.nullcontext()
