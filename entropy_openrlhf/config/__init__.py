"""One typed config for the whole trainer: nested dataclasses whose field help strings document every flag.

Command line flags are the dotted field paths, in OpenRLHF's style: `--actor.lr 1e-6 --loss.kl_cov.ratio 0.002`.
`--pretrain` is short for `--model.pretrain`. Everything is validated by `validate()` before any actor starts, and
logged to W&B as a flat dict (`flatten()`), so runs can be filtered by any hyper-parameter.

Where things live: sections/ (one module per `--section.*` flag group or small family of them), schema.py (`Config`,
assembled from the sections), paths.py (dotted names), cli.py (the parser, `from_args`, presets, `set_by_path`),
validation.py (`validate()`'s rules across sections, `ConfigError`), base.py (`Section` and the shared checks).
This module hands on the public names, so `from entropy_openrlhf.config import X` is the way in.
"""

from entropy_openrlhf.config.base import Section
from entropy_openrlhf.config.cli import apply_preset, build_parser, from_args, set_by_path
from entropy_openrlhf.config.schema import Config, reference_gpus, reference_max_tokens, reference_micro_batch_size
from entropy_openrlhf.config.sections.actor import ActorConfig
from entropy_openrlhf.config.sections.logger_ray import LoggerConfig, RayConfig
from entropy_openrlhf.config.sections.loss import AlgoConfig, EntropyConfig, LossConfig, LossOptions
from entropy_openrlhf.config.sections.model_data import DataConfig, ModelConfig
from entropy_openrlhf.config.sections.offpolicy import OffPolicySection
from entropy_openrlhf.config.sections.reference import REF_GPUS_AUTO, RefConfig, reference_uses_deepspeed
from entropy_openrlhf.config.sections.reward_eval import EvalConfig, RewardConfig
from entropy_openrlhf.config.sections.rollout import RolloutConfig
from entropy_openrlhf.config.sections.tools import ToolsConfig
from entropy_openrlhf.config.sections.train import AsyncConfig, SyncConfig, TrainConfig
from entropy_openrlhf.config.validation import ConfigError, validate

__all__ = [
    "REF_GPUS_AUTO",
    "ActorConfig",
    "AlgoConfig",
    "AsyncConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EntropyConfig",
    "EvalConfig",
    "LoggerConfig",
    "LossConfig",
    "LossOptions",
    "ModelConfig",
    "OffPolicySection",
    "RayConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "Section",
    "SyncConfig",
    "ToolsConfig",
    "TrainConfig",
    "apply_preset",
    "build_parser",
    "from_args",
    "reference_gpus",
    "reference_max_tokens",
    "reference_micro_batch_size",
    "reference_uses_deepspeed",
    "set_by_path",
    "validate",
]
