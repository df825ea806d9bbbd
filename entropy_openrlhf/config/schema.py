"""`Config`: every section in the order of `--help` and of `flatten()`, plus the values derived across sections
(`is_async`, `off_policy`, the reference's GPUs and micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from entropy_openrlhf.algorithms.off_policy import OffPolicyConfig
from entropy_openrlhf.config.paths import _walk
from entropy_openrlhf.config.sections.actor import ActorConfig
from entropy_openrlhf.config.sections.logger_ray import LoggerConfig, RayConfig
from entropy_openrlhf.config.sections.loss import AlgoConfig, EntropyConfig, LossConfig
from entropy_openrlhf.config.sections.model_data import DataConfig, ModelConfig
from entropy_openrlhf.config.sections.offpolicy import OffPolicySection
from entropy_openrlhf.config.sections.reference import REF_GPUS_AUTO, RefConfig
from entropy_openrlhf.config.sections.reward_eval import EvalConfig, RewardConfig
from entropy_openrlhf.config.sections.rollout import RolloutConfig
from entropy_openrlhf.config.sections.tools import TOOL_ROLLOUTS, ToolsConfig
from entropy_openrlhf.config.sections.train import AsyncConfig, SyncConfig, TrainConfig
from entropy_openrlhf.options import option as _f
from entropy_openrlhf.presets import PRESETS


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"name": "async"})
    offpolicy: OffPolicySection = field(default_factory=OffPolicySection)
    sync: SyncConfig = field(default_factory=SyncConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    preset: str = _f("", f"named preset applied before the flags: {' | '.join(PRESETS)}")

    def flatten(self) -> dict[str, Any]:
        return dict(_walk(self))

    @property
    def is_async(self) -> bool:
        return self.async_.max_staleness > 0

    @property
    def uses_tools(self) -> bool:
        """Whether the run's rollout function runs tool calls in the sandbox pool (--tools.*): the run then checks
        the sandbox before any actor starts and reserves the pool's workers."""
        return self.rollout.function in TOOL_ROLLOUTS

    @property
    def uses_reference(self) -> bool:
        """Whether the reference model runs: --ref.enabled true, or auto with a KL term that uses it."""
        return self.ref.enabled == "true" or (self.ref.enabled == "auto" and self.algo.kl_coef > 0)

    @property
    def starts_reference_group(self) -> bool:
        """Whether a reference group starts: the run uses the reference, and it is not LoRA's (under
        --actor.lora_rank the policy's own ranks give the base model's log-probs with the adapter off)."""
        return self.uses_reference and self.actor.lora_rank == 0

    @property
    def off_policy(self) -> OffPolicyConfig:
        """The off-policy correction the trainer applies: --offpolicy.* when a preset or a field is set, else the
        default, token TIS capped at 2 on async runs and none on synchronous ones (docs/algorithms/off_policy.md).
        ValueError for a setting that cannot work (validate() reports it as a ConfigError first)."""
        return self.offpolicy.resolve(self.is_async)


def reference_gpus(cfg: Config) -> float:
    """The GPUs the reference actor reserves: --ref.num_gpus, or for -1 (auto) one policy rank's GPU share, at most
    one (a forward pass uses one device), and 0 when the policy ranks train on the CPU. 0 when the reference is off."""
    if not cfg.starts_reference_group:
        return 0.0
    if cfg.ref.num_gpus == REF_GPUS_AUTO:
        return min(1.0, cfg.actor.num_gpus_per_worker)
    return cfg.ref.num_gpus


def reference_micro_batch_size(cfg: Config) -> int:
    """Sequences per reference forward: --ref.micro_batch_size, or the policy's when it is 0."""
    return cfg.ref.micro_batch_size or cfg.actor.micro_batch_size


def reference_max_tokens(cfg: Config) -> int:
    """Tokens per reference forward: --ref.max_tokens_per_micro_batch, or the policy's budget when it is 0 (0 for
    both: micro-batches of reference_micro_batch_size sequences)."""
    return cfg.ref.max_tokens_per_micro_batch or cfg.train.max_tokens_per_micro_batch
