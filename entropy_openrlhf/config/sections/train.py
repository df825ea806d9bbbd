"""The training loop: the `--train.*` flags (steps, mini-batches, checkpoints), the `--async.*` flags (rollouts that
lag the trainer) and the `--sync.*` flags (weight sync to the engines; its fields live in sync/factory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.config.base import Section, _failed
from entropy_openrlhf.options import option as _f  # short: every field below uses it
from entropy_openrlhf.sync.factory import WeightSyncSettings


@dataclass
class TrainConfig(Section):
    num_steps: int = _f(20, "RL steps (rollout batches)")
    mini_batches: int = _f(2, "optimizer steps per rollout batch (KL-Cov needs > 1 to act)")
    ppo_epochs: int = _f(
        1,
        "passes over each rollout batch, each one optimizer step per mini-batch against the same old log-probs "
        "(verl's ppo_epochs, OpenRLHF's --train.max_epochs, TRL's num_iterations; the paper's recipe: 1)",
    )
    seed: int = _f(42, "seed of data order, vLLM sampling and Clip-Cov's random choice")
    output_dir: str = _f(
        "",
        "checkpoints, the final HF model, metrics.jsonl and the loggers' folders (wandb/, tensorboard/, mlruns/) go "
        "here. Not given: outputs/run under the "
        "current folder, or ~/entropy-openrlhf/outputs/run under `ray job submit --working-dir` (Ray deletes its "
        "copy of the working dir with the job); a relative folder given there is refused",
    )
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

    step_timeout_s: float = _f(
        14400.0,
        "a policy train step (all ranks) that takes longer fails, naming the ranks still running; raise it for long "
        "responses on large models",
    )
    save_timeout_s: float = _f(
        3600.0, "writing or loading a checkpoint or the final model (all policy ranks) that takes longer fails"
    )
    max_tokens_per_micro_batch: int = _f(
        0,
        "token budget of one policy micro-batch (prompt + response tokens of its sequences; a longer sequence runs "
        "alone): micro-batches formed by tokens, balanced over the ranks, instead of --actor.micro_batch_size "
        "sequences (0). The gradient is the same; a per-micro-batch selection (--loss.scope micro_batch) is not",
    )
    head_chunk_tokens: int = _f(
        0,
        "training-side forwards (old log-probs, policy, reference) compute the vocabulary projection, log-probs and "
        "entropies this many response tokens at a time, recomputing each chunk in the backward, instead of all "
        "logits at once (0): bounds the logits' memory, ~1.8 MiB per token at a 152k vocabulary, for long responses",
    )

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps in one RL step: one per mini-batch in each of the passes (what the lr schedule counts)."""
        return self.mini_batches * self.ppo_epochs

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps in the whole run: the learning-rate schedule's length."""
        return self.num_steps * self.optimizer_steps_per_step

    def checks(self) -> list[str]:
        return _failed(
            (self.num_steps >= 1, "train.num_steps", "must be >= 1"),
            (self.ppo_epochs >= 1, "train.ppo_epochs", f"{self.ppo_epochs} must be >= 1"),
            (
                self.head_chunk_tokens >= 0,
                "train.head_chunk_tokens",
                f"{self.head_chunk_tokens} must be >= 0 (0 = all logits at once)",
            ),
            (self.step_timeout_s > 0, "train.step_timeout_s", f"{self.step_timeout_s:g} must be > 0"),
            (self.save_timeout_s > 0, "train.save_timeout_s", f"{self.save_timeout_s:g} must be > 0"),
            (
                self.max_tokens_per_micro_batch >= 0,
                "train.max_tokens_per_micro_batch",
                f"{self.max_tokens_per_micro_batch} must be >= 0 (0 = --actor.micro_batch_size sequences)",
            ),
            (self.save_every >= 0, "train.save_every", "must be >= 0"),
            (self.keep_checkpoints >= 0, "train.keep_checkpoints", "must be >= 0 (0 = keep all)"),
            (self.mini_batches >= 1, "train.mini_batches", "must be >= 1"),
        )


@dataclass
class AsyncConfig(Section):
    max_staleness: int = _f(1, "policy versions a rollout may lag the trainer (0 = synchronous)")

    def checks(self) -> list[str]:
        return _failed((self.max_staleness >= 0, "async.max_staleness", f"{self.max_staleness} must be >= 0"))


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
