"""The DeepSpeed checks: ZeRO-2 and ZeRO-3 optimizer steps through the engine builder and the step's phases a
policy rank runs, on a one-rank process group."""

from __future__ import annotations

import math
import os

import deepspeed
import torch

from entropy_openrlhf.actors.policy_engine import build_lr_scheduler, build_policy_engine, total_optimizer_steps
from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.actors.train_phases import (
    RankSetup,
    old_log_probs,
    optimizer_step,
    prepare_step,
    response_log_probs,
    step_result,
)
from entropy_openrlhf.config import Config, from_args
from entropy_openrlhf.gpu_check.common import DTYPE_NAMES, TOLERANCES, Check, Context
from entropy_openrlhf.rendezvous import init_default_group


def start_process_group(device: torch.device) -> None:
    """A one-rank default group (gloo on the CPU, NCCL on a GPU) on a store of our own on 127.0.0.1, which
    DeepSpeed adopts: what a policy rank does with its peers (policy_actor.py), with none."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(device.index or 0))
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_default_group(backend, "127.0.0.1", 0, 0, 1, 60.0)  # port 0: one the OS picks; nobody else connects
    deepspeed.init_distributed(dist_backend=backend)


def zero_config(ctx: Context, stage: int, head_chunk: int = 0) -> Config:
    """A small run's config: 2 prompts x 4 samples per step in 2 mini-batches of 2 micro-batches, 3 steps, the
    learning rate on a linear schedule down to half (so each optimizer step has its own rate); the output head in
    chunks of `head_chunk` response tokens (0 = whole)."""
    lr = 1e-3 if ctx.model_name == "tiny" else 2e-5
    flags = [
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "2",
        "--actor.micro_batch_size", "2", "--train.num_steps", "3", "--actor.zero_stage", str(stage),
        "--model.dtype", DTYPE_NAMES[ctx.dtype], "--actor.lr", str(lr), "--actor.lr_scheduler", "linear",
        "--actor.min_lr_ratio", "0.5", "--loss.type", "ppo", "--async.max_staleness", "0", "--ref.enabled", "false",
        "--train.shared_prefix", "auto", "--train.seed", str(ctx.seed),
        # ZeRO-3 as the DAPO presets run it: with gradient checkpointing
        "--actor.gradient_checkpointing", "true" if stage == 3 else "false",
        "--train.head_chunk_tokens", str(head_chunk),
    ]  # fmt: skip
    return from_args(flags)


def fixed_samples(vocab: int, seed: int) -> list[tuple[list[int], list[int], float]]:
    """2 prompts x 4 responses of random tokens, advantages +1 and -1 within each group (GRPO's signs)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        prompt = torch.randint(3, vocab, (12,), generator=gen).tolist()
        for j in range(4):
            length = int(torch.randint(5, 15, (1,), generator=gen))
            out.append((prompt, torch.randint(3, vocab, (length,), generator=gen).tolist(), 1.0 if j % 2 else -1.0))
    return out


def batch_policy_loss(rows: list[tuple[list[int], list[int], float]], log_probs: list[list[float]]) -> float:
    """-sum_i A_i x mean_t log p_i,t over the batch: what the steps should lower."""
    return -sum(a * sum(lp) / len(lp) for (_, _, a), lp in zip(rows, log_probs)) / len(rows)


def check_zero(ctx: Context, stage: int) -> Check:
    """Three RL steps of the policy on one fixed batch through the trainer's own engine builder and step phases."""
    name = f"zero{stage}"
    cfg = zero_config(ctx, stage)
    built = build_policy_engine(cfg, ctx.model_path, world_size=1)
    engine = built.engine
    try:
        setup = RankSetup(cfg, 0, 1, built.pad_id)
        vocab = engine.module.config.vocab_size
        rows = fixed_samples(vocab, ctx.seed)
        prompts, responses = [p for p, _, _ in rows], [r for _, r, _ in rows]

        def policy_loss() -> float:
            return batch_policy_loss(rows, response_log_probs(setup, engine, prompts, responses))

        # on-policy samples: the rollout's log-probs are the starting policy's
        start = response_log_probs(setup, engine, prompts, responses)
        samples = [TrainSample(p, r, a, lp) for (p, r, a), lp in zip(rows, start)]
        before = policy_loss()
        lrs, losses, norms, skipped = [], [], [], 0
        for step in range(cfg.train.num_steps):
            s = prepare_step(setup, engine, samples, step, 1.0, None)
            old_log_probs(setup, engine, s, range(len(s.batches)))
            engine.train()
            for mini in range(cfg.train.mini_batches):
                skipped += not optimizer_step(setup, engine, s, mini, False)
                lrs.append(s.lr)
            result = step_result(s, world_size=1, skipped=skipped, lr=s.lr, seconds=0.0)
            losses.append(result["loss/policy"])
            norms.append(result.get("train/grad_norm", math.nan))
        after = ctx.planted(name, policy_loss())
        # the rates the schedule gives each optimizer step, from a plain optimizer: DeepSpeed must step it once per
        # optimizer step (not per micro-batch) for the engine's to match
        dummy = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.actor.lr)
        a = cfg.actor
        sched = build_lr_scheduler(dummy, a.lr_scheduler, a.lr_warmup_steps, a.min_lr_ratio, total_optimizer_steps(cfg))
        want_lrs = []
        for _ in lrs:
            want_lrs.append(dummy.param_groups[0]["lr"])
            dummy.step()
            sched.step()
        on_schedule = all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(lrs, want_lrs))
        finite = all(math.isfinite(x) for x in (*losses, *norms, before, after))
        ok = finite and skipped == 0 and after < before and on_schedule
        return Check(name, ok, (
            f"{len(lrs)} optimizer steps of {built.micro_per_step} micro-batches ({DTYPE_NAMES[built.dtype]}, "
            f"{type(engine.optimizer).__name__}{', gradient checkpointing' if a.gradient_checkpointing else ''}): "
            f"policy loss on the batch {before:.4f} -> {after:.4f}, finite {finite}, skipped {skipped}, grad norms "
            f"{', '.join(f'{x:.3g}' for x in norms)}, lr {lrs[0]:.3g} -> {lrs[-1]:.3g} on schedule {on_schedule}"
        ))  # fmt: skip
    finally:
        engine.destroy()  # its hooks and buffers; run_checks then frees the memory


def check_head_chunk(ctx: Context, chunk: int = 5) -> Check:
    """`--train.head_chunk_tokens` under ZeRO-3 with gradient checkpointing: from the same weights, on the same
    batch, the output head whole and in chunks of `chunk` response tokens (each chunk's head gathered again in the
    backward) must give the same log-probs in the no-grad pass, the same first optimizer step (its gradient norm; its
    loss is 0 on policy, with advantages of +1 and -1) and the same policy loss on the batch after it."""
    tol = TOLERANCES[ctx.dtype]
    runs: list[tuple[torch.Tensor, float, float]] = []
    rows: list[tuple[list[int], list[int], float]] = []
    samples: list[TrainSample] = []
    for tokens in (0, chunk):
        cfg = zero_config(ctx, 3, head_chunk=tokens)
        built = build_policy_engine(cfg, ctx.model_path, world_size=1)
        engine = built.engine
        try:
            setup = RankSetup(cfg, 0, 1, built.pad_id)
            if not rows:
                rows = fixed_samples(engine.module.config.vocab_size, ctx.seed)
            prompts, responses = [p for p, _, _ in rows], [r for _, r, _ in rows]
            lps = response_log_probs(setup, engine, prompts, responses)
            if not samples:  # on-policy: the rollout's log-probs are the starting weights' (whole head)
                samples = [TrainSample(p, r, a, lp) for (p, r, a), lp in zip(rows, lps)]
            s = prepare_step(setup, engine, samples, 0, 1.0, None)
            old_log_probs(setup, engine, s, range(len(s.batches)))
            engine.train()
            applied = optimizer_step(setup, engine, s, 0, False)
            result = step_result(s, world_size=1, skipped=int(not applied), lr=s.lr, seconds=0.0)
            after = response_log_probs(setup, engine, prompts, responses)
            after_loss = batch_policy_loss(rows, after)
            flat = torch.tensor([x for lp in lps for x in lp], dtype=torch.float64)
            runs.append((flat, result.get("train/grad_norm", math.nan), after_loss))
        finally:
            engine.destroy()
    (lp0, norm0, after0), (lp1, norm1, after1) = runs
    norm1 = ctx.planted("head-chunk", norm1)
    d = (lp1 - lp0).abs()

    def rel(a: float, b: float) -> float:
        return abs(a - b) / abs(b) if b else math.inf

    errors = (rel(norm1, norm0), rel(after1, after0))
    ok = float(d.mean()) <= tol.packed_mean and float(d.max()) <= tol.packed_max and max(errors) <= tol.step_rel
    return Check("head-chunk", ok, (
        f"ZeRO-3, {DTYPE_NAMES[ctx.dtype]}, {lp0.numel()} response tokens, head in chunks of {chunk} against whole: "
        f"log-probs mean/max |d| {float(d.mean()):.2g}/{float(d.max()):.2g} "
        f"(<= {tol.packed_mean:g}/{tol.packed_max:g}); "
        f"relative difference of the step's gradient norm {errors[0]:.2g}, of the batch's loss after the step "
        f"{errors[1]:.2g} (<= {tol.step_rel:g})"
    ))  # fmt: skip
