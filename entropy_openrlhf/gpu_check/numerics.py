"""The numeric checks: the log-prob forward, every objective, the entropy and its bonus, the off-policy module
(each on the device against a reference), and that neither Ray nor vLLM was imported."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from entropy_openrlhf.actors.forward import SeqBatch, forward_log_probs, make_seq_batch, use_shared_prefix
from entropy_openrlhf.algorithms.loss_terms import entropy_bonus
from entropy_openrlhf.algorithms.metrics import token_entropy, token_entropy_with_grad
from entropy_openrlhf.algorithms.objectives import OBJECTIVES, LossContext, run_objective
from entropy_openrlhf.algorithms.off_policy import PRESETS as OFF_POLICY_PRESETS
from entropy_openrlhf.algorithms.off_policy import correct
from entropy_openrlhf.config import from_args
from entropy_openrlhf.gpu_check.common import (
    DTYPE_NAMES,
    OBJECTIVE_SETTINGS,
    TOLERANCES,
    WIDER,
    Check,
    Context,
    load_model,
    max_rel_diff,
    sampled_batch,
)


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
    b_err = abs(float(bonus.detach()) - float(bonus64)) / abs(float(bonus64))
    g_err = max_rel_diff(leaf.grad, grad64)
    ok = max(h_err, b_err, g_err) <= tol and bool(torch.isfinite(leaf.grad).all())
    return Check("entropy", ok, (
        f"{int(valid.sum())} tokens x {vocab} vocab from {DTYPE_NAMES[ctx.dtype]} logits, chunks of 64: relative "
        f"error entropy {h_err:.2g}, bonus {b_err:.2g}, bonus gradient {g_err:.2g} (<= {tol:g}), "
        "NaN padding kept out"
    ))  # fmt: skip


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
