"""The `--ref.*` flags: the frozen reference model, its ranks and Ray resources, and whether it runs under DeepSpeed.

The reference's GPUs and micro-batch that follow the policy's (`reference_gpus`, `reference_micro_batch_size`) read
other sections too: they live beside `Config`, in schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.config.base import _CUSTOM_HELP, Section, _custom_resource_errors, _failed, _ray_amount_errors
from entropy_openrlhf.options import option as _f  # short: every field below uses it

REF_GPUS_AUTO = -1.0  # --ref.num_gpus: follow the policy ranks' hardware (reference_gpus)


@dataclass
class RefConfig(Section):
    enabled: str = _f(
        "auto",
        "run the frozen reference model: auto (only when --algo.kl_coef > 0 uses it) | true (also for the kl/ref "
        "metric alone) | false",
        choices=("auto", "true", "false"),
    )
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
    max_tokens_per_micro_batch: int = _f(
        0,
        "token budget of one reference forward (prompt + response tokens; a longer sequence runs alone), instead of "
        "--ref.micro_batch_size sequences; 0 = --train.max_tokens_per_micro_batch (and sequences when that is 0)",
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
                    self.max_tokens_per_micro_batch >= 0,
                    "ref.max_tokens_per_micro_batch",
                    f"{self.max_tokens_per_micro_batch} must be >= 0 (0 = the policy's)",
                ),
                (
                    self.micro_batch_size >= 0,
                    "ref.micro_batch_size",
                    f"{self.micro_batch_size} must be >= 0 (0 = the policy's)",
                ),
            )  # fmt: skip
            + _custom_resource_errors(self.custom_resources, "ref")
        )


def reference_uses_deepspeed(ref: RefConfig) -> bool:
    """Whether the reference runs under DeepSpeed ZeRO-3 (several ranks, or CPU offload) rather than as one plain
    transformers model. Always stage 3: a reference is spread over ranks only because its parameters do not fit one
    device, and ZeRO-3 is the stage that splits parameters (stages 1 and 2 split optimizer state and gradients, which
    a frozen model has none of) and the one CPU offload of parameters needs. Each rank still runs its own share of
    the batch, so the ranks add throughput as replicas would."""
    return ref.num_workers > 1 or ref.offload
