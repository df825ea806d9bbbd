"""Named presets: `--preset NAME` on any pipeline, applied after the pipeline's own defaults and before flags."""

from __future__ import annotations

from typing import Any

from entropy_openrlhf.config import Config, set_by_path

# Loss settings of each pipeline (ENTROPY_SPEC.md section 4.1, "Clip ratios by run").
PIPELINES: dict[str, dict[str, Any]] = {
    "grpo": {"loss.type": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2},
    "clip_higher": {"loss.type": "clip_higher", "loss.clip_low": 0.2, "loss.clip_high": 0.28},
    "clip_cov": {"loss.type": "clip_cov", "loss.clip_low": 1.0, "loss.clip_high": 1.0},
    "kl_cov": {"loss.type": "kl_cov"},
}

# The paper's recipe (ENTROPY_SPEC.md section 4): GRPO n=8, 256 prompts per step in 8 optimizer mini-batches,
# lr 1e-6, responses up to 8192 tokens at T=1, no KL and no entropy bonus, DAPO dynamic sampling.
_DAPO_COMMON: dict[str, Any] = {
    "rollout.batch_size": 256,
    "rollout.n_samples_per_prompt": 8,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.max_new_tokens": 8192,
    "rollout.max_model_len": 10240,
    "train.mini_batches": 8,
    "actor.lr": 1e-6,
    "actor.grad_clip": 1.0,
    "actor.zero_stage": 3,
    "actor.gradient_checkpointing": True,
    "actor.micro_batch_size": 2,
    "algo.kl_coef": 0.0,
    "algo.dynamic_sampling": True,
    "algo.max_gen_batches": 10,
    "model.dtype": "bf16",
    "ref.enabled": False,
    "loss.kl_cov.coef": 1.0,
    "loss.clip_cov.ratio": 2e-4,
    "loss.clip_cov.lb": 1.0,
    "loss.clip_cov.ub": 5.0,
    "eval.every": 4,
    "train.save_every": 32,
}

PRESETS: dict[str, dict[str, Any]] = {
    # A tiny random model made on the spot, 2 steps: the whole path (vLLM, verifier, DeepSpeed, sync, W&B) in minutes.
    "smoke": {
        "model.pretrain": "tiny",
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 24,
        "rollout.max_model_len": 1024,
        "train.num_steps": 2,
        "train.mini_batches": 2,
        "actor.micro_batch_size": 4,
        "actor.lr": 1e-4,
        "reward.num_workers": 1,
        "logger.sample_table_every": 1,
        "loss.kl_cov.ratio": 0.02,
        "loss.clip_cov.ratio": 0.02,
    },
    # One 8-GPU node: 4 engines x TP 2 would leave nothing to train on, so 2 engines x TP2 + 4 trainer GPUs.
    "qwen2.5-7b-dapo": {
        **_DAPO_COMMON,
        "loss.kl_cov.ratio": 2e-3,
        "rollout.num_engines": 2,
        "rollout.tensor_parallel_size": 2,
        "rollout.num_gpus_per_engine": 1.0,
        "actor.num_workers": 4,
        "actor.num_gpus_per_worker": 1.0,
    },
    # Four 8-GPU nodes: 8 engines x TP 2 (16 GPUs) and 16 trainer GPUs.
    "qwen2.5-32b-dapo": {
        **_DAPO_COMMON,
        "loss.kl_cov.ratio": 2e-4,
        "rollout.num_engines": 8,
        "rollout.tensor_parallel_size": 2,
        "rollout.num_gpus_per_engine": 1.0,
        "actor.num_workers": 16,
        "actor.num_gpus_per_worker": 1.0,
        "actor.micro_batch_size": 1,
    },
}


def apply_preset(cfg: Config, name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    for key, value in PRESETS[name].items():
        set_by_path(cfg, key, value)
