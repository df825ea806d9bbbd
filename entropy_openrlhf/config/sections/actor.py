"""The `--actor.*` flags: the DeepSpeed policy ranks, their Ray resources and their AdamW optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.config.base import _CUSTOM_HELP, Section, _custom_resource_errors, _failed, _ray_amount_errors
from entropy_openrlhf.options import option as _f  # short: every field below uses it


@dataclass
class ActorConfig(Section):
    num_workers: int = _f(1, "data-parallel DeepSpeed policy actors")
    num_cpus_per_worker: float = _f(1.0, "Ray CPUs per policy actor")
    num_gpus_per_worker: float = _f(0.0, "Ray GPUs per policy actor")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="policy rank", example='{"node_b": 1}'))
    lr: float = _f(
        1e-5,
        "AdamW peak learning rate, shaped by --actor.lr_scheduler (the paper's 1e-6 is for 7B/32B: the qwen presets "
        "set it)",
    )
    lr_scheduler: str = _f(
        "constant",
        "learning-rate schedule over the run's optimizer steps (train.num_steps x train.mini_batches x "
        "train.ppo_epochs): {choices}; cosine and linear decay from --actor.lr after the warmup to "
        "--actor.min_lr_ratio x lr at the last step",
        choices=("constant", "cosine", "linear"),
    )
    lr_warmup_steps: int = _f(
        0, "optimizer steps (not RL steps) of linear warmup from 0 to --actor.lr before the schedule (0 = none)"
    )
    min_lr_ratio: float = _f(0.0, "cosine and linear: the learning rate they end at, as a fraction of --actor.lr")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_betas: list = _f([0.9, 0.999], "AdamW betas")
    adam_eps: float = _f(1e-8, "AdamW epsilon (PyTorch's default)")
    grad_clip: float = _f(1.0, "global gradient-norm clip")
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage (0-3)")
    micro_batch_size: int = _f(4, "sequences per forward/backward on one actor")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    lora_rank: int = _f(
        0,
        "train low-rank adapters of this rank instead of the whole model (0 = full fine-tuning): the base stays "
        "frozen, the reference is the base with the adapter off (no reference group), checkpoints hold the adapter",
    )
    lora_alpha: float = _f(32.0, "LoRA scaling numerator: the adapter's update is scaled by alpha / rank")
    lora_dropout: float = _f(
        0.0,
        "dropout on the adapter's input; keep 0: dropout makes the old-log-prob pass and the training forward differ",
    )
    lora_target_modules: str = _f(
        "all-linear",
        "modules that get an adapter: all-linear (every linear layer of attention and MLP, not the LM head) or "
        "comma-separated module names (q_proj,v_proj)",
    )

    def checks(self) -> list[str]:
        return (
            _failed(
                (self.lr > 0, "actor.lr", f"{self.lr} must be > 0"),
                (self.lr_warmup_steps >= 0, "actor.lr_warmup_steps", f"{self.lr_warmup_steps} must be >= 0"),
                # transformers' linear-to-lr_end schedule needs lr_end below the peak (and a ratio 1 is no decay)
                (0 <= self.min_lr_ratio < 1, "actor.min_lr_ratio", f"{self.min_lr_ratio} must be in [0, 1)"),
                (
                    self.min_lr_ratio == 0 or self.lr_scheduler != "constant",
                    "actor.min_lr_ratio",
                    "a constant schedule stays at --actor.lr: only cosine and linear decay to the ratio",
                ),
                (self.grad_clip >= 0, "actor.grad_clip", "must be >= 0"),
                (self.adam_eps > 0, "actor.adam_eps", f"{self.adam_eps} must be > 0"),
                (
                    len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                    "actor.adam_betas",
                    f"{','.join(map(str, self.adam_betas))}: give two values in [0, 1), e.g. 0.9,0.999",
                ),
                (self.weight_decay >= 0, "actor.weight_decay", f"{self.weight_decay} must be >= 0"),
                (self.zero_stage in (0, 1, 2, 3), "actor.zero_stage", "must be 0, 1, 2 or 3"),
                (self.num_workers >= 1, "actor.num_workers", "must be >= 1"),
                (self.micro_batch_size >= 1, "actor.micro_batch_size", "must be >= 1"),
                (self.lora_rank >= 0, "actor.lora_rank", f"{self.lora_rank} must be >= 0 (0 = full fine-tuning)"),
                (self.lora_alpha > 0, "actor.lora_alpha", f"{self.lora_alpha} must be > 0"),
                (0 <= self.lora_dropout < 1, "actor.lora_dropout", f"{self.lora_dropout} must be in [0, 1)"),
                (
                    bool(self.lora_target_modules.strip(" ,")),
                    "actor.lora_target_modules",
                    "give all-linear or module names",
                ),
            )
            + _ray_amount_errors(self, "actor", "num_gpus_per_worker", "num_cpus_per_worker")
            + _custom_resource_errors(self.custom_resources, "actor")
        )
