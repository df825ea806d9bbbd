"""The policy's DeepSpeed engine: its DeepSpeed config, the model, AdamW, the learning-rate schedule and
`deepspeed.initialize`, in one function that every policy rank (PolicyActor.__init__) and scripts/gpu_check.py
call, so that the GPU check steps the very engine the trainer trains.

The learning-rate schedule (`--actor.lr_scheduler`, `--actor.lr_warmup_steps`, `--actor.min_lr_ratio`) counts
optimizer steps: a run takes `train.num_steps x train.mini_batches x train.ppo_epochs` of them
(`total_optimizer_steps`). It is one of transformers' schedules (OpenRLHF builds its actor's the same way, with
`get_scheduler`), handed to `deepspeed.initialize`, so DeepSpeed owns it: the engine steps it once per applied
optimizer step (at the gradient-accumulation boundary, never per micro-batch; a step skipped for a non-finite
gradient does not advance it, so a skip delays the rest of the schedule by one step), and `save_checkpoint` /
`load_checkpoint` write and restore its state with the model's (deepspeed/runtime/engine.py, `_take_model_step`,
`lr_scheduler` in the checkpoint). A resumed run continues the schedule where the checkpoint left it.

Actor-only, like train_phases.py: DeepSpeed and transformers read their settings (DS_ACCELERATOR, HF_HUB_OFFLINE)
when imported, so a caller imports this module after setting them: a policy rank after `set_cpu_defaults`,
gpu_check.py after choosing its device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM
from transformers.integrations.deepspeed import HfDeepSpeedConfig
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_polynomial_decay_schedule_with_warmup,
)

from entropy_openrlhf.actors.chunked_head import use_chunked_head
from entropy_openrlhf.actors.lora import apply_lora
from entropy_openrlhf.config import Config
from entropy_openrlhf.models.dtype import resolve_dtype


@dataclass
class PolicyEngine:
    """What building the engine gives its rank."""

    engine: Any  # the DeepSpeed engine (its module is the HF model, its lr_scheduler the schedule)
    dtype: torch.dtype  # the weights' dtype (models/dtype.py)
    micro_per_step: int  # micro-batches per optimizer step on this rank: DeepSpeed's gradient accumulation
    pad_id: int
    dropout_free: bool  # no dropout anywhere: a training forward computes what an eval forward does
    load_info: dict[str, float]  # how the model's load went on this rank (seconds, memory; below)
    # ZeRO-3: transformers finds the DeepSpeed config only through a weak reference, so this one keeps it alive for
    # the engine's life (build_policy_engine)
    hf_ds_config: Any = None


def total_optimizer_steps(cfg: Config) -> int:
    """The optimizer steps of the whole run, the length of the learning-rate schedule: `train.mini_batches` per pass,
    `train.ppo_epochs` passes per RL step, `train.num_steps` RL steps."""
    return cfg.train.total_optimizer_steps


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, min_lr_ratio: float, total_steps: int
) -> LambdaLR:
    """The schedule of `--actor.lr_scheduler name` over `total_steps` optimizer steps, on `optimizer`'s learning
    rate (its peak, `--actor.lr`). Optimizer step k (from 0) runs at lr x f(k):

    - warmup, k < warmup_steps: f = k / warmup_steps (the first step at 0, as transformers' and OpenRLHF's);
    - constant: f = 1;
    - cosine: f = m + (1 - m) (1 + cos(pi p)) / 2, p = (k - warmup_steps) / (total_steps - warmup_steps), m the ratio;
    - linear: f = m + (1 - m) (1 - p), so both decay from lr to min_lr_ratio x lr at k = total_steps.
    """
    if name == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup_steps)
    if name == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, warmup_steps, total_steps, min_lr_rate=min_lr_ratio
        )
    if name == "linear":
        # transformers' linear schedule ends at 0; its polynomial one of power 1 is the same line to lr_end
        lr_end = min_lr_ratio * optimizer.defaults["lr"]
        return get_polynomial_decay_schedule_with_warmup(optimizer, warmup_steps, total_steps, lr_end=lr_end, power=1.0)
    raise ValueError(f"--actor.lr_scheduler {name!r}: constant | cosine | linear")


def ds_config(cfg: Config, dtype: torch.dtype, micro_per_step: int) -> dict:
    """The policy's DeepSpeed config."""
    return {
        "train_micro_batch_size_per_gpu": cfg.actor.micro_batch_size,
        "gradient_accumulation_steps": micro_per_step,
        "gradient_clipping": cfg.actor.grad_clip,
        "zero_optimization": {"stage": cfg.actor.zero_stage},
        # with check_grad_overflow DeepSpeed skips bf16 steps with non-finite gradients (fp32 ZeRO does by default)
        "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def build_policy_engine(cfg: Config, model_path: str, world_size: int) -> PolicyEngine:
    """This rank's DeepSpeed engine of the policy in `model_path`, its optimizer and schedule in it. The default
    process group (all `world_size` ranks) must be up, DeepSpeed's `init_distributed` run, and the rank's device
    current."""
    dtype = resolve_dtype(cfg.model.dtype, model_path)
    per_rank = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt // cfg.train.mini_batches // world_size
    micro_per_step = math.ceil(per_rank / cfg.actor.micro_batch_size)
    config = ds_config(cfg, dtype, micro_per_step)
    # ZeRO-3: with an HfDeepSpeedConfig alive, from_pretrained builds the model inside deepspeed.zero.Init (each
    # parameter partitioned on this rank's device as its module is created) and fills it one module at a time:
    # rank 0 copies the checkpoint's tensors into the gathered parameters, the other ranks receive them, each
    # keeps its partition. No rank holds the whole model and only rank 0 reads the checkpoint. Without it every
    # rank holds the whole model until DeepSpeed partitions it: as mmap'd views of the safetensors files when
    # their dtype is the training dtype, but as a private copy when cast (131 GB per rank for 32B in fp32).
    # transformers finds the config only through a weak reference (integrations/deepspeed.py,
    # is_deepspeed_zero3_enabled), so PolicyEngine keeps it alive, as its docstring asks: transformers calls made
    # later in this process (embedding resizes, weight inits) must see ZeRO-3 too.
    hf_ds_config = HfDeepSpeedConfig(config) if cfg.actor.zero_stage == 3 else None
    private_before, t0 = _private_host_bytes(), time.time()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    load_info = {
        "seconds": time.time() - t0,
        # parameter elements this rank holds in full: 0 under zero.Init (each keeps only its partition)
        "full_param_elements": sum(p.numel() for p in model.parameters()),
        # anonymous memory the load left in this process; the checkpoint's mmap'd file pages are not counted
        # (the page cache holds them once per node)
        "private_host_growth_bytes": _private_host_bytes() - private_before,
    }
    # actor-only import (policy_actor.py's docstring), after the model is built, where it has always run: forward.py
    # registers flash-attn stand-ins (compat.py) that the model's loading has never seen
    from entropy_openrlhf.actors.forward import use_shared_prefix

    use_shared_prefix(model, cfg.train.shared_prefix)  # before DeepSpeed wraps it; each batch brings its layout
    use_chunked_head(model, cfg.train.head_chunk_tokens)
    if cfg.actor.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if cfg.actor.lora_rank:
        model = apply_lora(model, cfg)  # the base frozen: only the adapters' parameters train (lora.py)
    dropout_free = not getattr(model.config, "attention_dropout", 0.0) and not any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
    )
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # under zero.Init these are already partitioned parameters; DeepSpeed's ZeRO-3 optimizer takes them as such
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # all of them, or LoRA's adapters
        lr=cfg.actor.lr,
        betas=tuple(cfg.actor.adam_betas),
        eps=cfg.actor.adam_eps,
        weight_decay=cfg.actor.weight_decay,
        # one kernel over all parameters: on CPU 0.18 s per step for SmolLM2 against 0.6 s for the default
        # per-tensor loop (docs/guides/benchmarks.md); the same update up to rounding
        fused=True,
    )
    a = cfg.actor
    scheduler = build_lr_scheduler(optimizer, a.lr_scheduler, a.lr_warmup_steps, a.min_lr_ratio,
                                   total_optimizer_steps(cfg))  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return PolicyEngine(engine, dtype, micro_per_step, pad_id, dropout_free, load_info, hf_ds_config)


def _private_host_bytes() -> int:
    """This process's anonymous (private) resident memory now; 0 where /proc/self/smaps_rollup is missing."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
