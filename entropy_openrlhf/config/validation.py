"""`validate()`: the rules across sections (each section checks its own flags in `Section.checks`), and `ConfigError`,
raised for a config that cannot work.
"""

from __future__ import annotations

import dataclasses
import warnings

from entropy_openrlhf.algorithms.objectives import OBJECTIVES, within_chain
from entropy_openrlhf.config.base import Section
from entropy_openrlhf.config.paths import _name
from entropy_openrlhf.config.schema import Config, reference_gpus
from entropy_openrlhf.config.sections.reference import REF_GPUS_AUTO


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
                     "group gets no GPU and runs on the CPU, its processes seeing none of the node's GPUs")  # fmt: skip
    need(
        not (cfg.algo.kl_coef > 0 and not cfg.uses_reference),
        "algo.kl_coef",
        "needs the reference model (--ref.enabled true)",
    )

    need(
        cfg.sync.method != "adapter" or a.lora_rank > 0,
        "sync.method",
        "adapter sends a LoRA adapter: it needs --actor.lora_rank > 0",
    )
    need(
        a.lora_rank <= 512,
        "actor.lora_rank",
        f"{a.lora_rank}: vLLM serves adapters up to rank 512",
    )
    need(
        cfg.reward.overlong_buffer_len <= r.max_new_tokens,
        "reward.overlong_buffer_len",
        f"{cfg.reward.overlong_buffer_len} is longer than --rollout.max_new_tokens {r.max_new_tokens}",
    )
    # The built-in task brings its own test split, but only when it is the training data too (run.resolve_data):
    # with --data.train and no --data.test there is nothing to evaluate, which a run would otherwise find out with
    # one line among its start-up output and then train for days unevaluated (a preset's eval.every, say).
    tests = [p for p in cfg.data.test.split(",") if p.strip()]
    need(
        not (cfg.eval.every > 0 and cfg.data.train and not tests),
        "eval.every",
        f"{cfg.eval.every} evaluates on --data.test, and none is given (with --data.train {cfg.data.train} the "
        "built-in task's test split is not used): give --data.test, or --eval.every 0 to train without evaluating",
    )
    # the schedule's length (actors/policy_engine.py, total_optimizer_steps): a warmup that long never reaches
    # --actor.lr, and past their end transformers' cosine schedules rise again
    total_steps = cfg.train.total_optimizer_steps
    need(
        a.lr_warmup_steps < total_steps,
        "actor.lr_warmup_steps",
        f"{a.lr_warmup_steps} is not below the run's {total_steps} optimizer steps "
        "(--train.num_steps x --train.mini_batches x --train.ppo_epochs)",
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
        one_micro_batch = 0 < per_step <= cfg.actor.micro_batch_size and not cfg.train.max_tokens_per_micro_batch
        if cfg.actor.num_workers == 1 and one_micro_batch:
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
        not (cfg.starts_reference_group and cfg.ref.num_gpus == 0 and a.num_gpus_per_worker > 0),
        "ref.num_gpus",
        f"0 puts the reference model on the CPU in fp32 while the policy ranks have GPUs (--actor.num_gpus_per_worker "
        f"{a.num_gpus_per_worker:g}): leave it at -1 (auto: {min(1.0, a.num_gpus_per_worker):g} GPU, the policy's "
        "hardware), give it GPUs, or turn it off with --ref.enabled false",
    )


def _validate_reference(cfg: Config, need) -> None:
    """The reference's GPUs against the policy's: its ranks on one device, CPU offload without a GPU."""
    ref = cfg.ref
    if not cfg.starts_reference_group:
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
            # ppo, cispo, gspo, sapo, dppo, ce_gppo: nothing of theirs to scale; the controller drives the bonus alone
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
    if lc.dual_clip and lc.type not in ("ppo", "ce_gppo"):
        notes.append(f"--loss.dual_clip applies to ppo and ce_gppo only; {lc.type} ignores it")
