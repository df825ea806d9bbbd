"""Named presets: `--preset NAME` on any pipeline, applied after the pipeline's own defaults and before flags.

Data only, as dotted flag names and values (config.py applies them), so that config.py can import it.
`entropy_openrlhf.resources` says what a preset reserves on a Ray cluster.
"""

from __future__ import annotations

from typing import Any

# Loss settings of each pipeline (docs/algorithms/losses.md, "The paper's recipe in the presets"). The PPO clip does
# nothing
# to KL-Cov's loss (unclipped by design, docs/algorithms/losses.md "KL-Cov"), so kl_cov leaves it alone.
PIPELINES: dict[str, dict[str, Any]] = {
    "grpo": {"loss.type": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2},
    "clip_higher": {"loss.type": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.28},  # DAPO's clip-higher
    "clip_cov": {"loss.type": "clip_cov", "loss.clip_low": 1.0, "loss.clip_high": 1.0},
    "kl_cov": {"loss.type": "kl_cov"},
    # The newer objectives, each at its own paper's defaults (docs/algorithms/losses.md). The 80/20 method keeps PPO's
    # clip.
    "high_entropy": {"loss.type": "high_entropy"},
    "cispo": {"loss.type": "cispo"},
    "gspo": {"loss.type": "gspo"},
    # SAPO at its temperatures 1.0 / 1.05 (verl, TRL and SkyRL); DPPO with the binary-TV region of 0.15 and TIS at 20
    # (TRL); CE-GPPO as its authors run it: the 7B recipe's betas 0.75 / 1.0 on a PPO clip of 0.2 / 0.2, with the
    # dual clip of 10 every recipe of theirs applies
    "sapo": {"loss.type": "sapo"},
    "dppo": {"loss.type": "dppo"},
    "ce_gppo": {"loss.type": "ce_gppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2, "loss.dual_clip": 10.0},
}

# The paper's recipe (docs/algorithms/losses.md; the verl recipe scripts): GRPO n=8, 256 prompts per step in 8
# optimizer mini-batches of 32 prompts, lr 1e-6 constant, AdamW with no weight decay, grad clip 1, prompts up to 2048
# and responses up to 8192 tokens at T=1 / top_p 1, no KL (no reference model) and no entropy bonus, DAPO dynamic
# sampling with up to 10 generation rounds, token-mean loss, evaluation every 4 steps and a checkpoint every 32.
# KL-Cov beta 1; Clip-Cov 2e-4 of the tokens with covariance bounds 1 and 5 (its PPO clip of 1 is the clip_cov
# pipeline's). Ratios are fractions. The KL-Cov ratio differs by model size and is set below.
_DAPO_COMMON: dict[str, Any] = {
    # data: verl/DAPO parquet rows (a chat message list in `prompt`, the answer in reward_model.ground_truth)
    "data.input_key": "prompt",
    "data.label_key": "reward_model.ground_truth",
    # algorithm
    "rollout.batch_size": 256,
    "rollout.n_samples_per_prompt": 8,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.max_new_tokens": 8192,
    "rollout.max_model_len": 2048 + 8192,  # max_prompt_length + max_response_length
    "train.mini_batches": 8,
    "actor.lr": 1e-6,
    # constant, no warmup: the verl recipe scripts pass optim.warmup_style=constant and leave lr_warmup_steps_ratio
    # at its default 0. Stated here so that a change of the flags' defaults cannot change the recipe
    "actor.lr_scheduler": "constant",
    "actor.lr_warmup_steps": 0,
    "actor.weight_decay": 0.0,
    "actor.grad_clip": 1.0,
    "algo.advantage": "grpo",
    "algo.kl_coef": 0.0,
    "algo.dynamic_sampling": True,
    "algo.max_gen_batches": 10,
    "loss.agg": "token_mean",
    # Overlong responses as the recipe's scripts have them: DAPO's overlong buffer off (the dapo reward manager with
    # overlong_buffer.enable=False, so no length penalty) and responses cut at the limit kept in the loss (verl has no
    # such mask there). Stated so that a change of the flags' defaults cannot change the recipe
    "reward.overlong_buffer_len": 0,
    "loss.mask_truncated": False,
    # Covariance selection over each optimizer mini-batch on all ranks (the paper's definition). With one sequence
    # per micro-batch (below), selecting per micro-batch would take max(1, floor(ratio x N)) of one response's N
    # tokens: at 2e-4, one token of every response shorter than 10000, several times the paper's ratio.
    "loss.scope": "global",
    "loss.kl_cov.coef": 1.0,
    "loss.clip_cov.ratio": 2e-4,
    "loss.clip_cov.lb": 1.0,
    "loss.clip_cov.ub": 5.0,
    "ref.enabled": "false",
    "eval.every": 4,
    "train.save_every": 32,
    # systems: bf16, ZeRO-3 with gradient checkpointing (the recipe: FSDP with checkpointing). One sequence per
    # micro-batch: a full-length one is 10240 tokens, and the trainer materialises its (tokens x 152k vocab)
    # logits; with their fp32 copy and gradient about 1.8 MiB per token at the step's peak, 18 GiB here (measured
    # on a GPU: benchmarks/long_responses.py, docs/guides/long_responses.md). The head in chunks of 1024 tokens bounds
    # that to about 2 GiB, for under 2% more arithmetic (verl's recipe uses its fused kernels to the same end). Raise
    # the micro-batch, or form micro-batches by tokens (--train.max_tokens_per_micro_batch), when responses stay short.
    "model.dtype": "bf16",
    "actor.zero_stage": 3,
    "actor.gradient_checkpointing": True,
    "actor.micro_batch_size": 1,
    "train.head_chunk_tokens": 1024,
    # one sequence per micro-batch leaves no prompt to share: keep the model's own attention (shared-prefix packing
    # pays when a micro-batch holds several responses of a prompt; docs/guides/gpu.md)
    "train.shared_prefix": "off",
    # 2048 responses per step to verify (the fork uses a 64-process pool); a quarter CPU each (Ray's accounting)
    # keeps the whole 7B run within the 16 logical CPUs of a local Ray (--ray.num_cpus)
    "reward.num_workers": 16,
    "reward.num_cpus_per_worker": 0.25,
    # vLLM on GPUs. CUDA graphs on: responses run to 8192 tokens, and the long tail of a round decodes a few
    # sequences at a time, where kernel launches dominate each step without graphs. The engines have their GPUs to
    # themselves (the trainer ranks hold others), so 0.9 of the memory goes to weights, CUDA graphs and KV cache;
    # the 8 GB left of an 80 GB GPU take the weight sync's NCCL buffers and the one tensor it receives at a time
    # (1.1-1.5 GB). Prefix caching on (vLLM's default): the 8 samples of a prompt share its blocks. The per-step
    # token budget stays vLLM's per-GPU choice (16384 on H100; 8192 on A100, where more was slower). The presets
    # below set max_num_seqs to each engine's share of a generation round (256 prompts x 8).
    "rollout.enforce_eager": "false",
    "rollout.gpu_memory_utilization": 0.9,
    "rollout.enable_prefix_caching": True,
    "rollout.max_num_batched_tokens": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Clip-Cov at small scale (docs/algorithms/losses.md, "At small scale"): on the built-in task with SmolLM2 and
    # micro-batches
    # of 4 x ~30 response tokens, the paper's 2e-4 of ~128 tokens is the one-token floor, and the paper's absolute
    # bounds stop holding any token once covariances shrink as the policy sharpens. Bounds counted in standard
    # deviations of the token covariances follow them down; from 0.5 std with a ratio of 0.1 Clip-Cov detaches 1-3 %
    # of the tokens all through a run (38-57 % of those inside the bounds). What it gives is a selection that acts,
    # not a measured effect: over seven seeds (study/notebook.md) its entropy and accuracy were level with GRPO's
    # (entropy 1.04x, not significant); ratio 0.05 with bounds from 1 std detached ~1 % and cost train accuracy.
    "clip-cov-small": {"loss.clip_cov.ratio": 0.1, "loss.clip_cov.lb": 0.5, "loss.clip_cov.bounds_unit": "std"},
    # A tiny random model made on the spot, 2 steps: the whole path (vLLM, verifier, DeepSpeed, sync, W&B) in minutes.
    # CI runs it on CPU: no GPU is reserved and the batch stays small.
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
    # Tool rollouts on the tiny model, 2 steps: the sandbox pool, multi-turn episodes streamed, tool turns masked out
    # of the loss (docs/guides/tools.md). A random model never writes a code block itself, so each prompt's answer
    # starts with the call that computes it (arith_tools_prefilled): every episode runs one call in the sandbox, and
    # its policy tokens come after the tool's output. CI runs it on CPU, like smoke.
    "tool-smoke": {
        "model.pretrain": "tiny",
        "rollout.function": "python_tool",
        "rollout.mode": "stream",
        "data.builtin_task": "arith_tools_prefilled",
        "data.builtin_levels": "4",
        "rollout.batch_size": 2,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 24,
        "rollout.max_model_len": 1024,
        "tools.max_total_tokens": 48,
        "tools.num_workers": 2,
        "train.num_steps": 2,
        "train.mini_batches": 2,
        "actor.micro_batch_size": 4,
        "actor.lr": 1e-4,
        "reward.num_workers": 1,
        "logger.sample_table_every": 1,
        "loss.kl_cov.ratio": 0.02,
        "loss.clip_cov.ratio": 0.02,
    },
    # The GPU preflight (scripts/gpu_preflight.sh): each GPU path once, on 4 GPUs of one node, in minutes. A small
    # real model comes with --pretrain (Qwen2.5-0.5B-Instruct: its 14 query and 2 KV heads split over TP 2).
    "gpu-smoke": {
        "model.dtype": "bf16",
        # one engine with TP 2: vLLM's multiprocess executor, and two engine workers in the sync group
        "rollout.num_engines": 1,
        "rollout.tensor_parallel_size": 2,
        "rollout.num_gpus_per_engine": 2.0,
        "rollout.enforce_eager": "false",  # CUDA graphs, as in the real presets
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 256,
        "rollout.max_model_len": 1024,
        # two ZeRO-3 ranks: zero.Init loading, the gathered export and broadcast, the ranks' NCCL rendezvous
        "actor.num_workers": 2,
        "actor.num_gpus_per_worker": 1.0,
        "actor.zero_stage": 3,
        "actor.gradient_checkpointing": True,
        "actor.micro_batch_size": 2,
        # ten times the recipe's: one step then moves the log-probs well past bf16's train/inference noise, so an
        # engine that kept old weights shows in the sync check
        "actor.lr": 1e-5,
        "train.num_steps": 2,
        "train.mini_batches": 2,
        "train.save_every": 2,
        "async.max_staleness": 0,  # the engines hold the trainer's weights at every step: what the check compares
        "sync.method": "collective",  # NCCL between the trainer and the engines (auto would pick it on GPUs too)
        "ref.enabled": "false",  # as in the recipe presets
        "reward.num_workers": 2,
        "logger.sample_table_every": 1,
    },
    # One 8-GPU node (80 GB GPUs): 2 vLLM engines x TP 2 (4 GPUs) + 4 DeepSpeed ranks (4 GPUs) = 8. The groups do
    # not share GPUs. ZeRO-3 over 4 ranks holds about 30 GB of model and optimizer state per GPU.
    "qwen2.5-7b-dapo": {
        **_DAPO_COMMON,
        "loss.kl_cov.ratio": 2e-3,
        "rollout.num_engines": 2,
        "rollout.tensor_parallel_size": 2,
        "rollout.num_gpus_per_engine": 2.0,
        "actor.num_workers": 4,
        "actor.num_gpus_per_worker": 1.0,
        "sync.timeout_s": 900.0,  # each sync moves the full 15 GB of bf16 weights; not measured on GPUs
        # 2048 responses per round / 2 engines. The KV cache (57 KB per token, ~120 GB per engine at 0.9) holds
        # ~2k tokens for each of the 1024 at once; beyond that vLLM preempts and recomputes the latest ones
        "rollout.max_num_seqs": 1024,
    },
    # Four 8-GPU nodes (80 GB GPUs): 8 vLLM engines x TP 2 (16 GPUs) + 16 DeepSpeed ranks (16 GPUs) = 32.
    # ZeRO-3 over 16 ranks holds about 33 GB of model and optimizer state per GPU.
    "qwen2.5-32b-dapo": {
        **_DAPO_COMMON,
        "loss.kl_cov.ratio": 2e-4,
        "rollout.num_engines": 8,
        "rollout.tensor_parallel_size": 2,
        "rollout.num_gpus_per_engine": 2.0,
        "actor.num_workers": 16,
        "actor.num_gpus_per_worker": 1.0,
        "sync.timeout_s": 1800.0,  # each sync moves the full 65 GB of bf16 weights; not measured on GPUs
        # 2048 responses per round / 8 engines. The KV cache (256 KB per token, ~70 GB per engine at 0.9 after the
        # 33 GB of weights per GPU) holds ~1k tokens for each of the 256 at once; beyond that vLLM preempts and
        # recomputes the latest ones. Lower it if the engines' logs show many preemptions.
        "rollout.max_num_seqs": 256,
    },
}
