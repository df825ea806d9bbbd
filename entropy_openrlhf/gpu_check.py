"""The one-device check (scripts/gpu_check.py): the trainer's numerics and its DeepSpeed step on one GPU, without
Ray or vLLM, in a few minutes. Each check prints one PASS or FAIL line with its numbers:

- forward: the policy's log-prob forward (actors/forward.py) in the working dtype, plain and with shared-prefix
  packing, against each other and against the same model one precision wider, where packing must be exact;
- objectives: every registered objective's loss, gradient and selection on the device against the CPU's;
- entropy: the chunked token entropy and the entropy bonus's gradient on the device against fp64 formulas;
- zero2, zero3: DeepSpeed ZeRO-2 and ZeRO-3 optimizer steps of the policy on a fixed batch, through the engine
  builder (actors/policy_engine.py) and the step's phases (actors/train_phases.py) that a policy rank runs, on a
  one-rank process group: finite, applied, the batch's policy loss lower, the learning rate on its schedule;
- off-policy: every preset of algorithms/off_policy.py `correct` on the device against the CPU's;
- imports: neither Ray nor vLLM was imported.

The working dtype is bf16 on a GPU and fp32 on the CPU (bf16 matmuls are ~60x slower on CPUs without AMX:
models/dtype.py); "one precision wider" is fp32 for bf16 and fp64 for fp32, so the CPU twin (`--device cpu`, run by
tests/integration/test_gpu_check.py) compares something too. The objectives and `correct` compute in fp32 whatever
their inputs' dtype (loss_terms.prepare), so their reference is the CPU's fp32 from the same numbers held in fp64:
on a GPU the lines compare CUDA's kernels (reductions, sorts, top-k) with the CPU's; on the CPU twin both sides are
one computation and agree exactly. The tolerances are `TOLERANCES`, per working dtype.

Import this module only after the device's environment is set (scripts/gpu_check.py does): DeepSpeed picks its
accelerator from DS_ACCELERATOR when it is imported, as on a policy rank (policy_actor.py's docstring).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from entropy_openrlhf.actors.forward import SeqBatch, forward_log_probs, make_seq_batch, use_shared_prefix
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
from entropy_openrlhf.algorithms.loss_terms import entropy_bonus
from entropy_openrlhf.algorithms.metrics import token_entropy, token_entropy_with_grad
from entropy_openrlhf.algorithms.objectives import OBJECTIVES, LossContext, run_objective
from entropy_openrlhf.algorithms.off_policy import PRESETS as OFF_POLICY_PRESETS
from entropy_openrlhf.algorithms.off_policy import correct
from entropy_openrlhf.config import Config, from_args
from entropy_openrlhf.models.smollm2 import ensure_smollm2
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.rendezvous import init_default_group

CHECKS = ("cuda", "forward", "objectives", "entropy", "zero2", "zero3", "off-policy", "imports")
WIDER = {torch.bfloat16: torch.float32, torch.float32: torch.float64}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class Tolerances:
    """What each comparison allows, in the working dtype. Log-probs in nats, over the response tokens."""

    wide_mean: float  # mean |log-prob - the wider dtype's|
    wide_max: float  # max of the same
    packed_mean: float  # mean |packed - plain|, both in the working dtype
    packed_max: float
    exact_max: float  # max |packed - plain| one precision wider, where packing is exact up to rounding
    rel: float  # losses, gradients, entropies, weights and metrics computed in fp32 on the device against fp64


TOLERANCES = {
    # fp32 against fp64: rounding alone. Measured on CPU, mean/max: the tiny model 2e-7/7e-7, SmolLM2 2.5e-6/2.3e-5
    # (packed against plain in fp32 the same; in fp64 they agreed exactly)
    torch.float32: Tolerances(
        wide_mean=1e-5, wide_max=1e-4, packed_mean=1e-5, packed_max=1e-4, exact_max=1e-9, rel=1e-4
    ),
    # bf16 weights and activations against fp32: 8 bits of mantissa, per-token errors of a few hundredths that
    # accumulate over the layers. SmolLM2 in bf16 on a CPU with bf16 support (AMD EPYC, AVX-512 BF16) gave mean/max
    # 0.028/0.18 nats against fp32, packed 0.03/0.36, packed against plain 0.034/0.33; the bounds leave GPU kernels
    # about 3x that. A layout bug that bf16's noise could hide shows in exact_max, the same forward in fp32 (GPU
    # fp32 matmuls and SDPA stay fp32 unless TF32 is switched on, which nothing here does).
    torch.bfloat16: Tolerances(wide_mean=0.1, wide_max=2.0, packed_mean=0.1, packed_max=2.0, exact_max=1e-4, rel=1e-4),
}

# The objectives' settings for the check: quotas large enough to select many of its 120 tokens, Clip-Cov's bounds
# where this batch's covariances lie (as tests/unit/test_objectives_through_registry.py does)
OBJECTIVE_SETTINGS: dict[str, dict[str, Any]] = {
    "clip_cov": {"ratio": 0.2, "lb": 0.5, "ub": 2.0},
    "kl_cov": {"ratio": 0.15},
    "high_entropy": {"top_frac": 0.3},
}
PLANT = 0.5  # what --plant adds to the checked value of one check, so that the test sees it fail


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name:<10}  {self.detail} ({self.seconds:.1f} s)"


@dataclass
class Context:
    """What every check is given."""

    device: torch.device
    dtype: torch.dtype  # the working dtype
    model_path: str
    model_name: str  # tiny, smollm2 or the folder
    plant: str  # the check whose value --plant perturbs ("" = none)
    seed: int = 0

    def planted(self, name: str, x: Any) -> Any:
        """`x` with PLANT added when --plant names this check: the comparison after it must then fail."""
        return x + PLANT if self.plant == name else x


# ------------------------------------------------------------------ helpers


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(|want|, 1e-12): one relative error for a whole tensor, in fp64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12)) if want.numel() else 0.0


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model.to(device).eval()


def sampled_batch(
    model: torch.nn.Module, path: str, device: torch.device, n_prompts: int = 3, n_samples: int = 4, seed: int = 0
) -> tuple[list[list[int]], list[list[int]], int]:
    """Chat prompts, each repeated n_samples times in consecutive rows (as a GRPO batch is, so packing shares them),
    with responses sampled from `model`: the tokens a policy would score. Returns prompts, responses, pad id."""
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts, responses = [], []
    torch.manual_seed(seed)
    for q in ("What is 17 + 25?", "Tom has 4 apples and gets 9 more. How many now?", "Name a prime above 10.")[
        :n_prompts
    ]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, max_new_tokens=24, min_new_tokens=6,
                num_return_sequences=n_samples, pad_token_id=pad, use_cache=True,
            )  # fmt: skip
        for row in out[:, len(ids) :].tolist():
            eos = tok.eos_token_id
            cut = row.index(eos) + 1 if eos in row else len(row)  # up to the first end of turn, as vLLM stops
            prompts.append(ids)
            responses.append(row[:cut])
    return prompts, responses, pad


# ------------------------------------------------------------------ the checks


def check_cuda(ctx: Context) -> Check:
    """The device itself (GPU only): its name, compute capability, bf16 support and memory."""
    props = torch.cuda.get_device_properties(ctx.device)
    bf16 = torch.cuda.is_bf16_supported()
    ok = bf16 or ctx.dtype != torch.bfloat16
    return Check("cuda", ok, (
        f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, bf16 "
        f"{'supported' if bf16 else 'NOT supported'}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    ))  # fmt: skip


def check_forward(ctx: Context) -> Check:
    """Log-probs of sampled responses, plain and packed, in the working dtype and one precision wider."""
    tol, wide = TOLERANCES[ctx.dtype], WIDER[ctx.dtype]
    ref = load_model(ctx.model_path, wide, ctx.device)
    prompts, responses, pad = sampled_batch(ref, ctx.model_path, ctx.device, seed=ctx.seed)
    attention = ref.config._attn_implementation
    b: SeqBatch = make_seq_batch(prompts, responses, pad).to(ctx.device)
    bp = make_seq_batch(prompts, responses, pad, shared_prefix="on", model_config=ref.config).to(ctx.device)

    def log_probs(dtype: torch.dtype, packed: bool) -> torch.Tensor:
        model = ref if dtype == wide and not packed else load_model(ctx.model_path, dtype, ctx.device)
        if packed:
            use_shared_prefix(model, "on")
        with torch.no_grad():
            return forward_log_probs(model, bp if packed else b)[0].double()

    lp_wide, lp_wide_packed = log_probs(wide, False), log_probs(wide, True)
    lp_plain = log_probs(ctx.dtype, False)
    lp_packed = ctx.planted("forward", log_probs(ctx.dtype, True))
    m = b.mask.bool()
    n = int(m.sum())

    def gap(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        d = (x - y)[m].abs()
        return (float(d.mean()), float(d.max())) if torch.isfinite(d).all() else (math.inf, math.inf)

    w_mean, w_max = gap(lp_plain, lp_wide)
    pw_mean, pw_max = gap(lp_packed, lp_wide)
    p_mean, p_max = gap(lp_packed, lp_plain)
    _, exact = gap(lp_wide_packed, lp_wide)
    ok = (
        max(w_mean, pw_mean) <= tol.wide_mean
        and max(w_max, pw_max) <= tol.wide_max
        and p_mean <= tol.packed_mean
        and p_max <= tol.packed_max
        and exact <= tol.exact_max
        and len(bp.packed.rows) < len(prompts)  # the packed batch shared its prompts
    )
    d, dw = DTYPE_NAMES[ctx.dtype], DTYPE_NAMES[wide]
    return Check("forward", ok, (
        f"{n} tokens of {len(prompts)} responses in {len(bp.packed.rows)} packed rows, attention {attention} "
        f"(packed: prefix_split over SDPA); {d} vs {dw} mean/max |dlogp| plain {w_mean:.2g}/{w_max:.2g}, packed "
        f"{pw_mean:.2g}/{pw_max:.2g} (<= {tol.wide_mean:g}/{tol.wide_max:g}); packed vs plain {d} "
        f"{p_mean:.2g}/{p_max:.2g} (<= {tol.packed_mean:g}/{tol.packed_max:g}), {dw} max {exact:.2g} "
        f"(<= {tol.exact_max:g})"
    ))  # fmt: skip


def objective_inputs(seed: int) -> dict[str, torch.Tensor]:
    """One micro-batch of per-token inputs, fp32 values (so that the fp64 copy holds the very same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = 8, 15
    lengths = torch.tensor([15, 3, 9, 12, 1, 15, 7, 11])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    lp = -torch.rand(rows, width, generator=gen) * 3
    return {
        "log_probs": lp,
        "old_log_probs": lp + 0.4 * torch.randn(rows, width, generator=gen),
        "advantages": torch.randn(rows, 1, generator=gen).expand(rows, width) * mask,
        "mask": mask,
        "entropy": torch.rand(rows, width, generator=gen) * 3,
        "is_weights": 0.5 + torch.rand(rows, width, generator=gen),
    }


def run_one_objective(
    name: str, params: Any, loss_cfg: Any, inputs: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """Loss, gradient of the log-probs, selection and mean |token loss| of objective `name` on `device`, its inputs
    held in `dtype`."""
    x = {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()}
    lp = x["log_probs"].clone().requires_grad_(True)
    ctx = LossContext(clip_low=0.2, clip_high=0.28, generator=torch.Generator().manual_seed(11))
    out, _ = run_objective(name, params, loss_cfg, ctx, lp, x["old_log_probs"], x["advantages"], x["mask"],
                           entropy=x["entropy"], is_weights=x["is_weights"])  # fmt: skip
    out.loss.backward()
    scale = float((out.token_loss.detach().abs() * x["mask"]).sum() / x["mask"].sum())
    return out.loss.detach(), lp.grad, out.selected, scale


def check_objectives(ctx: Context) -> Check:
    """Every registered objective on the device against the CPU (module docstring: both compute in fp32)."""
    tol = TOLERANCES[ctx.dtype].rel
    loss_cfg = from_args([]).loss  # for a `within` chain; the objectives' own settings are set below
    inputs = objective_inputs(ctx.seed)
    worst_loss = worst_grad = 0.0
    bad = []
    for name in sorted(OBJECTIVES):
        params = dataclasses.replace(OBJECTIVES[name].config(), **OBJECTIVE_SETTINGS.get(name, {}))
        cpu = torch.device("cpu")
        loss64, grad64, sel64, scale = run_one_objective(name, params, loss_cfg, inputs, cpu, torch.float64)
        loss, grad, sel, _ = run_one_objective(name, params, loss_cfg, inputs, ctx.device, torch.float32)
        loss = ctx.planted("objectives", loss)
        # relative to the loss, or to its terms' size where they cancel to near 0
        e_loss = abs(float(loss) - float(loss64)) / max(abs(float(loss64)), scale, 1e-12)
        e_grad = max_rel_diff(grad, grad64)
        same_selection = (sel is None) == (sel64 is None) and (sel is None or torch.equal(sel.cpu(), sel64.cpu()))
        worst_loss, worst_grad = max(worst_loss, e_loss), max(worst_grad, e_grad)
        if not (e_loss <= tol and e_grad <= tol and same_selection):
            bad.append(f"{name} (loss {e_loss:.2g}, grad {e_grad:.2g}, same selection {same_selection})")
    detail = (
        f"{len(OBJECTIVES)} objectives ({', '.join(sorted(OBJECTIVES))}) on {ctx.device.type} vs cpu (fp32 math): "
        f"worst relative error loss {worst_loss:.2g}, gradient {worst_grad:.2g} (<= {tol:g}), same selections"
    )
    return Check("objectives", not bad, detail if not bad else "failed: " + "; ".join(bad))


def check_entropy(ctx: Context) -> Check:
    """Chunked entropy (no grad) and the entropy bonus's gradient, from working-dtype logits, against fp64
    formulas written out here; padding rows hold NaN logits that must not reach the bonus or its gradient."""
    tol = TOLERANCES[ctx.dtype].rel
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    rows, width, vocab, coef = 6, 50, 5003, 0.01
    logits = (torch.randn(rows, width, vocab, generator=gen) * 3).to(ctx.dtype)
    lengths = torch.tensor([50, 17, 33, 1, 42, 8])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    logits[~mask.bool()] = float("nan")  # garbage on padding, as a real batch may hold
    valid = mask.bool()

    z64 = logits.double()[valid]  # the same numbers, widened: (N, V)
    h64 = torch.logsumexp(z64, -1) - (torch.softmax(z64, -1) * z64).sum(-1)
    # the bonus -coef * mean H over valid tokens, and its gradient dH/dz = -p (z - E_p[z]) spread over N tokens
    p64 = torch.softmax(z64, -1)
    grad64 = torch.zeros(rows, width, vocab, dtype=torch.float64)
    grad64[valid] = coef / valid.sum() * p64 * (z64 - (p64 * z64).sum(-1, keepdim=True))
    bonus64 = -coef * h64.mean()

    dev_logits = logits.to(ctx.device)
    h = token_entropy(dev_logits, chunk_size=64)
    leaf = dev_logits.float().requires_grad_(True)
    ent = token_entropy_with_grad(leaf, chunk_size=64)
    bonus = entropy_bonus(ent, mask.to(ctx.device), coef)
    bonus.backward()
    h_err = max_rel_diff(ctx.planted("entropy", h[valid.to(ctx.device)]), h64)
    b_err = abs(float(bonus) - float(bonus64)) / abs(float(bonus64))
    g_err = max_rel_diff(leaf.grad, grad64)
    ok = max(h_err, b_err, g_err) <= tol and bool(torch.isfinite(leaf.grad).all())
    return Check("entropy", ok, (
        f"{int(valid.sum())} tokens x {vocab} vocab from {DTYPE_NAMES[ctx.dtype]} logits, chunks of 64: relative "
        f"error entropy {h_err:.2g}, bonus {b_err:.2g}, bonus gradient {g_err:.2g} (<= {tol:g}), "
        "NaN padding kept out"
    ))  # fmt: skip


def zero_config(ctx: Context, stage: int) -> Config:
    """A small run's config: 2 prompts x 4 samples per step in 2 mini-batches of 2 micro-batches, 3 steps, the
    learning rate on a linear schedule down to half (so each optimizer step has its own rate)."""
    lr = 1e-3 if ctx.model_name == "tiny" else 2e-5
    flags = [
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "2",
        "--actor.micro_batch_size", "2", "--train.num_steps", "3", "--actor.zero_stage", str(stage),
        "--model.dtype", DTYPE_NAMES[ctx.dtype], "--actor.lr", str(lr), "--actor.lr_scheduler", "linear",
        "--actor.min_lr_ratio", "0.5", "--loss.type", "ppo", "--async.max_staleness", "0", "--ref.enabled", "false",
        "--train.shared_prefix", "auto", "--train.seed", str(ctx.seed),
        # ZeRO-3 as the DAPO presets run it: with gradient checkpointing
        "--actor.gradient_checkpointing", "true" if stage == 3 else "false",
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
            """-sum_i A_i x mean_t log p_i,t over the batch: what the steps should lower."""
            lps = response_log_probs(setup, engine, prompts, responses)
            return -sum(a * sum(lp) / len(lp) for (_, _, a), lp in zip(rows, lps)) / len(rows)

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


def check_off_policy(ctx: Context) -> Check:
    """Every off-policy preset's weights, kept tokens and metrics on the device against the CPU (both fp32 math)."""
    tol = TOLERANCES[ctx.dtype].rel
    gen = torch.Generator().manual_seed(ctx.seed + 2)
    rows, width = 16, 40
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    rollout = -torch.rand(rows, width, generator=gen) * 4
    # old - rollout: a small common lag per response plus per-token noise, so bands and caps act on some tokens
    old = rollout + 0.3 * torch.randn(rows, 1, generator=gen) + 0.3 * torch.randn(rows, width, generator=gen)
    worst, bad = 0.0, []
    for preset, cfg in OFF_POLICY_PRESETS.items():
        want = correct(old.double(), rollout.double(), mask.double(), cfg)
        got = correct(old.to(ctx.device), rollout.to(ctx.device), mask.to(ctx.device), cfg)
        w_err = max_rel_diff(ctx.planted("off-policy", got.weights), want.weights)
        m_err = max(abs(got.metrics[k] - v) / max(abs(v), 1e-6) for k, v in want.metrics.items())
        same_keep = torch.equal(got.keep.cpu(), want.keep)
        worst = max(worst, w_err, m_err)
        if not (w_err <= tol and m_err <= tol and same_keep):
            bad.append(f"{preset} (weights {w_err:.2g}, metrics {m_err:.2g}, same kept tokens {same_keep})")
    detail = (
        f"{len(OFF_POLICY_PRESETS)} presets ({', '.join(OFF_POLICY_PRESETS)}) on {ctx.device.type} vs cpu (fp32 "
        f"math): worst relative error {worst:.2g} (<= {tol:g}), same kept tokens"
    )
    return Check("off-policy", not bad, detail if not bad else "failed: " + "; ".join(bad))


def check_imports(ctx: Context) -> Check:
    """The whole check ran without Ray or vLLM: a GPU machine without them can run it."""
    # a None entry is a module blocked from importing (how the test stands in for a machine without them)
    loaded = [m for m in ("ray", "vllm") if sys.modules.get(m) is not None]
    return Check("imports", not loaded, f"loaded: {', '.join(loaded)}" if loaded else "neither ray nor vllm imported")


# ------------------------------------------------------------------ running them


def model_path(name: str, workdir: Path) -> str:
    """tiny (a random 2-layer Llama made here), smollm2 (the package's GGUF, converted once) or an HF folder."""
    if name == "tiny":
        return str(make_tiny_model(workdir / "tiny"))
    if name == "smollm2":
        return ensure_smollm2()
    if not (Path(name) / "config.json").is_file():
        raise FileNotFoundError(f"--model {name}: tiny, smollm2 or an HF model folder")
    return name


def start_process_group(device: torch.device) -> None:
    """A one-rank default group (gloo on the CPU, NCCL on a GPU) on a store of our own on 127.0.0.1, which
    DeepSpeed adopts: what a policy rank does with its peers (policy_actor.py), with none."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(device.index or 0))
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_default_group(backend, "127.0.0.1", 0, 0, 1, 60.0)  # port 0: one the OS picks; nobody else connects
    deepspeed.init_distributed(dist_backend=backend)


def run_checks(device: str, model: str, dtype: str, only: list[str], plant: str) -> list[Check]:
    """Run the checks `only` names (all by default) and print each line as it finishes."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    work_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype) or (
        torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    selected = [c for c in CHECKS if (not only or c in only) and (c != "cuda" or dev.type == "cuda")]
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        path = model_path(model, Path(tmp))
        ctx = Context(dev, work_dtype, path, model, plant)
        print(f"[gpu-check] {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), model "
              f"{model} ({path}), {DTYPE_NAMES[work_dtype]} against {DTYPE_NAMES[WIDER[work_dtype]]}; torch "
              f"{torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}",
              flush=True)  # fmt: skip
        if any(c.startswith("zero") for c in selected):
            start_process_group(dev)
        runners: dict[str, Callable[[], Check]] = {
            "cuda": lambda: check_cuda(ctx),
            "forward": lambda: check_forward(ctx),
            "objectives": lambda: check_objectives(ctx),
            "entropy": lambda: check_entropy(ctx),
            "zero2": lambda: check_zero(ctx, 2),
            "zero3": lambda: check_zero(ctx, 3),  # last of the engines: its HfDeepSpeedConfig must not outlive it
            "off-policy": lambda: check_off_policy(ctx),
            "imports": lambda: check_imports(ctx),
        }
        for name in selected:
            t0 = time.time()
            try:
                check = runners[name]()
            except Exception as e:  # noqa: BLE001 - a check that raises is a FAIL line, and the others still run
                traceback.print_exc()
                check = Check(name, False, f"raised {type(e).__name__}: {e}")
            check.seconds = time.time() - t0
            print(check.line(), flush=True)
            checks.append(check)
            gc.collect()  # the check's models and engines, before the next one loads its own
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return checks
