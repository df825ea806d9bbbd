"""Loss overhead: what every registered objective costs on top of PPO, in a full policy train step and in the loss
alone.

The variants come from the objectives registry (`algorithms/objectives/`): every objective with `--loss.scope
micro_batch`, and every objective that selects tokens (it has a selector) with `--loss.scope global` too; then PPO
with the entropy-based advantage (`--algo.entropy_adv_alpha 0.4`, which any objective can take: it adds the token
entropy to the training forward and the shaping to each loss call, the same for every objective). Each
variant's loss settings are those of the pipeline of the same name (`presets.PIPELINES`, e.g. clip_cov's PPO clip of
1) over the defaults, as `python pipelines/<name>.py` would have them; an objective with no pipeline of its name
runs on the defaults.

Table 1 is the real thing: one `PolicyGroup` (a Ray actor with DeepSpeed on CPU) trains on the same fixed batch with
every variant. The variants share the one actor (its loss settings are replaced between steps), take turns within
every repeat (the order rotates), and each step is timed inside the actor (`time/train_actor`: old log-probs, every
mini-batch's forward, loss, backward and optimizer step). The ratio column is the median over repeats of (variant
step / the ppo step of the same repeat), so slow drifts of a shared machine cancel.

Table 2 times the objectives alone, driven the way the actor drives them (`select_tokens` per micro-batch, or one
`pooled_selection` over the mini-batch for the global scope, then the objective's loss forward and backward) on
synthetic shapes from the demo's micro-batch to the paper's, since the step is dominated by the model's forward and
backward.

    .venv/bin/python benchmarks/loss_overhead.py                    # SmolLM2-135M-Instruct, the demo's batch
    .venv/bin/python benchmarks/loss_overhead.py --model tiny       # a tiny random model: a quick check

Prints both tables, then `loss_overhead_max_ratio: <the largest step ratio to ppo among the micro_batch-scope
variants>` as the last line (target: 1.05 or less); exits non-zero when it could not measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

# torch, Ray, transformers and the package are imported inside the functions that use them: `--help` stays fast.

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = "loss_overhead_max_ratio"
BASELINE = "ppo"  # the objective every ratio is taken to
# the loss metrics that say what fraction of the valid tokens an objective's selector picked (first present wins)
SELECTED_FRACS = ("clip_cov_frac", "kl_cov_frac", "entropy_selected_frac")
# loss-alone shapes (micro-batch rows x response tokens, micro-batches per mini-batch)
SHAPES = [(4, 128, 4), (4, 1024, 4), (2, 8192, 8)]


ENTROPY_ADV = ("--algo.entropy_adv_alpha", "0.4")  # the option's variant: its GRPO setting


@dataclasses.dataclass(frozen=True)
class Variant:
    objective: str  # a name in the objectives registry (--loss.type)
    scope: str  # --loss.scope
    flags: tuple[str, ...] = ()  # an option on top (the entropy-based advantage)

    @property
    def label(self) -> str:
        return f"{self.objective} {self.scope}" + (" +entropy_adv" if self.flags else "")


def variants() -> list[Variant]:
    """Every objective in the registry's order, micro_batch scope; then the global scope of those with a selector
    (the scope means nothing to the others); then the baseline with the entropy-based advantage."""
    from entropy_openrlhf.algorithms.objectives import OBJECTIVES

    names = sorted(OBJECTIVES, key=lambda name: name != BASELINE)  # the baseline first, then the registry's order
    micro = [Variant(name, "micro_batch") for name in names]
    pooled = [Variant(name, "global") for name in names if OBJECTIVES[name].select is not None]
    return micro + pooled + [Variant(BASELINE, "micro_batch", ENTROPY_ADV)]


def variant_config(variant: Variant, flags: Sequence[str] = ()):
    """The trainer's config for `variant`: the defaults, then the `loss.*` settings of the pipeline named like the
    objective (if any), then `flags`, the objective and the scope; validated like a pipeline's."""
    from entropy_openrlhf.config import from_args, validate
    from entropy_openrlhf.presets import PIPELINES

    pipeline = {k: v for k, v in PIPELINES.get(variant.objective, {}).items() if k.startswith("loss.")}
    cfg = from_args([*flags, *variant.flags, "--loss.type", variant.objective, "--loss.scope", variant.scope], pipeline)
    validate(cfg)  # raises on settings that cannot work; its notes are warnings, not for a benchmark
    return cfg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | an HF model folder")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, else the checkpoint's) | bf16 | fp32")
    ap.add_argument("--samples", type=int, default=32, help="sequences in the batch (demo: 8 prompts x 4)")
    ap.add_argument("--prompt-len", type=int, default=160, help="prompt tokens per sequence")
    ap.add_argument("--response-len", type=int, default=128, help="response tokens per sequence (at most)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per batch (KL-Cov needs > 1)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per variant, after one warm-up each")
    ap.add_argument("--loss-repeats", type=int, default=30, help="timed calls per loss and shape")
    ap.add_argument("--loss-threads", type=int, default=1, help="torch threads for the loss-alone table")
    ap.add_argument("--skip-step", action="store_true", help="only the loss-alone table (no headline)")
    return ap.parse_args(argv)


def selected_frac(metrics: dict[str, float], prefix: str = "") -> float:
    return next((metrics[prefix + k] for k in SELECTED_FRACS if prefix + k in metrics), 0.0)


# --------------------------------------------------------------------------- table 1: the full train step


def fixed_batch(args, vocab: int, seed: int = 0):
    """GRPO-shaped samples: groups of 4 share a prompt and get normalised advantages; lengths vary a little."""
    from entropy_openrlhf.actors.policy import TrainSample

    rng = random.Random(seed)
    out = []
    for g in range(0, args.samples, 4):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        rewards = [float(rng.random() < 0.5) for _ in range(4)]
        mean = sum(rewards) / 4
        std = (sum((r - mean) ** 2 for r in rewards) / 3) ** 0.5 or 1.0
        for r in rewards[: args.samples - g]:
            n = rng.randint(args.response_len * 3 // 4, args.response_len)
            response = [rng.randrange(3, vocab) for _ in range(n)]
            # rollout log-probs near the trainer's, as an engine's would be
            out.append(TrainSample(prompt, response, (r - mean) / std, [-8.0 + rng.gauss(0, 0.05) for _ in range(n)]))
    return out


def set_loss(actor_self, loss_cfg, algo_cfg) -> None:
    """Runs inside the policy actor (`__ray_call__`): the loss settings of its next train_step. The whole `loss` and
    `algo` sections are replaced (the entropy-based advantage is an `algo` flag), so nothing one variant sets (a
    pipeline's clip, say) leaks into the next."""
    actor_self.cfg.loss = loss_cfg
    actor_self.cfg.algo = algo_cfg


def time_steps(args, model_path: str, runs: list[Variant]) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Seconds per train step of each variant over the repeats, and each variant's last step metrics."""
    import ray
    from transformers import AutoConfig

    from entropy_openrlhf.actors.policy import PolicyGroup

    flags = [
        "--model.dtype", args.dtype,
        "--rollout.batch_size", str(args.samples // 4),
        "--rollout.n_samples_per_prompt", "4",
        "--actor.micro_batch_size", str(args.micro_batch),
        "--train.mini_batches", str(args.mini_batches),
        "--actor.lr", "1e-7",  # the weights barely move: every step sees nearly the same model
    ]  # fmt: skip
    configs = {v.label: variant_config(v, flags) for v in runs}
    losses = {label: (cfg.loss, cfg.algo) for label, cfg in configs.items()}
    batch = fixed_batch(args, AutoConfig.from_pretrained(model_path).vocab_size)
    group = PolicyGroup(variant_config(runs[0], flags), model_path)
    times: dict[str, list[float]] = {v.label: [] for v in runs}
    last: dict[str, dict[str, float]] = {}
    step = 0
    try:
        for r in range(args.repeats + 1):  # repeat 0 is the warm-up
            k = r % len(runs)
            for v in runs[k:] + runs[:k]:
                ray.get([a.__ray_call__.remote(set_loss, *losses[v.label]) for a in group.actors], timeout=120)
                metrics = group.train_step(batch, step)
                step += 1
                if r > 0:
                    times[v.label].append(metrics["time/train_actor"])
                    last[v.label] = metrics
                print(f"  repeat {r} {v.label:<30} {metrics['time/train_actor']:7.2f} s", file=sys.stderr, flush=True)
    finally:
        group.shutdown()
    return times, last


def paired_ratios(times: dict[str, list[float]], base: str) -> dict[str, float]:
    return {name: statistics.median(t / b for t, b in zip(ts, times[base])) for name, ts in times.items()}


# --------------------------------------------------------------------------- table 2: the objectives alone


def make_mini_batch(rows: int, length: int, micro_per_mini: int, seed: int = 0) -> list:
    """Synthetic micro-batches of one optimizer mini-batch, as TokenBatches: sampled-token log-probs, a slightly
    older policy's, one advantage per row, token entropies, and the last 20 % of every row padding."""
    import torch

    from entropy_openrlhf.algorithms.objectives import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(micro_per_mini):
        lp = -torch.rand(rows, length, generator=gen) * 12
        old = lp + torch.randn(rows, length, generator=gen) * 0.05
        adv = torch.randn(rows, 1, generator=gen).expand(rows, length).contiguous()
        entropy = torch.rand(rows, length, generator=gen) * 4  # nats, within a vocabulary's range
        mask = torch.ones(rows, length)
        mask[:, int(length * 0.8) :] = 0
        micro.append(TokenBatch(lp, old, adv, mask, entropy=entropy))
    return micro


def run_mini_batch(micro: list, cfg) -> float:
    """What the actor's train_step does per mini-batch after its forwards: for the global scope one selection over
    all micro-batches, then per micro-batch `run_objective` (the shaping of the advantages when the entropy-based
    advantage is on, the selection in micro_batch scope, the objective's loss) and the loss's backward, normalised
    over the whole mini-batch. Returns the selected fraction, averaged over the micro-batches as the actor's metrics
    are."""
    import torch

    from entropy_openrlhf.algorithms.advantages import entropy_advantage
    from entropy_openrlhf.algorithms.objectives import (
        LossContext,
        get_objective,
        objective_needs_entropy,
        run_objective,
        select_tokens,
    )
    from entropy_openrlhf.algorithms.selection import pooled_selection

    lc = cfg.loss
    objective = get_objective(lc.type)
    params = getattr(lc, lc.type)  # the objective's config: its dataclass defaults plus the pipeline's settings
    shaping = cfg.algo.entropy_adv()
    needs_entropy = objective_needs_entropy(lc.type, lc) or shaping is not None
    # the actor's forward computes entropy only for the objectives (and the option) that read it
    micro = [dataclasses.replace(mb, entropy=mb.entropy if needs_entropy else None) for mb in micro]
    base = LossContext(
        clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip or None, agg=lc.agg,
        tokens=sum(float(mb.mask.sum()) for mb in micro),
        sequences=sum(float((mb.mask.sum(-1) > 0).sum()) for mb in micro),
        micro_batches=len(micro), entropy_adv=shaping,
    )  # fmt: skip
    selections = [None] * len(micro)
    if lc.scope == "global" and objective.select is not None:
        generator = torch.Generator().manual_seed(1)

        def select(tokens, means):
            ctx = dataclasses.replace(base, cov_means=means, generator=generator)
            return select_tokens(lc.type, params, lc, tokens, ctx)

        # the pooled advantages are the loss calls' own: shaped too when the option is on (train_phases does so)
        pooled = micro
        if shaping is not None:
            alpha, kappa = shaping
            pooled = [
                dataclasses.replace(mb, advantages=entropy_advantage(mb.advantages, mb.entropy, mb.mask,
                                                                     alpha=alpha, kappa=kappa))
                for mb in micro
            ]  # fmt: skip
        selections, cov_means, total, _ = pooled_selection(pooled, select, with_entropy=needs_entropy)
        base = dataclasses.replace(base, cov_means=cov_means, selected_total=float(total))
    fracs = []
    for i, mb in enumerate(micro):
        lp = mb.log_probs.clone().requires_grad_(True)
        ctx = dataclasses.replace(base, generator=torch.Generator().manual_seed(i), selected=selections[i])
        out, _ = run_objective(
            lc.type, params, lc, ctx, lp, mb.old_log_probs, mb.advantages, mb.mask, entropy=mb.entropy,
            is_weights=mb.is_weights,
        )  # fmt: skip
        out.loss.backward()
        fracs.append(selected_frac(out.metrics))
    return statistics.mean(fracs)


def time_losses(runs: list[Variant], repeats: int, threads: int) -> list[tuple[str, str, float, float, float]]:
    """(shape, variant, median ms per mini-batch, ratio to ppo, selected fraction) for every shape; the variants
    take turns.

    One thread by default: on a shared 2-core machine torch's thread pool waits for cores other processes hold, and
    these small element-wise ops then vary 10-20x between runs; a single thread keeps the comparison steady."""
    import torch

    torch.set_num_threads(threads)
    configs = {v.label: variant_config(v) for v in runs}
    rows = []
    for rows_per_micro, length, micro_per_mini in SHAPES:
        micro = make_mini_batch(rows_per_micro, length, micro_per_mini)
        seconds: dict[str, list[float]] = {v.label: [] for v in runs}
        fracs: dict[str, float] = {}
        for r in range(repeats + 2):  # 2 warm-up rounds
            for v in runs:
                t0 = time.perf_counter()
                fracs[v.label] = run_mini_batch(micro, configs[v.label])
                if r >= 2:
                    seconds[v.label].append(time.perf_counter() - t0)
        base = statistics.median(seconds[Variant(BASELINE, "micro_batch").label])
        for label, ts in seconds.items():
            med = statistics.median(ts)
            shape = f"{micro_per_mini}x{rows_per_micro}x{length}"
            rows.append((shape, label, med * 1000, med / base, fracs[label]))
    return rows


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    load_before = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory(prefix="loss_overhead_")
    try:
        runs = variants()
        loss_rows = time_losses(runs, args.loss_repeats, args.loss_threads)
        times, last = {}, {}
        if not args.skip_step:
            import ray

            from entropy_openrlhf.cluster import init_ray
            from entropy_openrlhf.models.builtin import model_folder

            model_path = model_folder(args.model, tmp.name)
            started = init_ray(num_cpus=8)
            try:
                times, last = time_steps(args, model_path, runs)
            finally:
                if started:
                    ray.shutdown()
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        print(f"error: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        tmp.cleanup()

    print(machine_line(load_before))
    baseline = Variant(BASELINE, "micro_batch").label
    if times:
        print(
            f"\nfull policy train step: model {args.model} ({args.dtype}), {args.samples} sequences x "
            f"({args.prompt_len} prompt + <= {args.response_len} response) tokens, micro-batch {args.micro_batch}, "
            f"{args.mini_batches} mini-batches, 1 DeepSpeed rank; median of {args.repeats} interleaved repeats"
        )
        ratios = paired_ratios(times, baseline)
        print(f"{'variant':<30}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio to ppo':>14}{'selected frac':>15}")
        for label, ts in times.items():
            print(
                f"{label:<30}{statistics.median(ts):>10.2f}{min(ts):>8.2f}{max(ts):>8.2f}{ratios[label]:>14.3f}"
                f"{selected_frac(last[label], 'loss/'):>15.4f}"
            )
    print(
        f"\nobjectives alone, per optimizer mini-batch (micro-batches x rows x tokens, 20 % padding): every "
        f"micro-batch's selection and loss forward + backward, for the global scope one selection over the "
        f"mini-batch instead; median of {args.loss_repeats}, {args.loss_threads} torch thread(s)"
    )
    print(f"{'shape':<14}{'variant':<30}{'median ms':>10}{'ratio to ppo':>14}{'selected frac':>15}")
    for shape, label, ms, ratio, frac in loss_rows:
        print(f"{shape:<14}{label:<30}{ms:>10.2f}{ratio:>14.2f}{frac:>15.4f}")
    if not times:
        print(f"{HEADLINE}: not measured (--skip-step)")
        return 1
    if any(len(ts) != args.repeats or min(ts) <= 0 for ts in times.values()):
        print(f"error: could not measure: a variant has {min(len(t) for t in times.values())} timed steps")
        return 1
    # the target is about the objectives as the reference code selects (per micro-batch); ppo's own ratio is 1 by
    # definition, so it is left out
    micro = [v.label for v in runs if v.scope == "micro_batch" and v.label != baseline]
    print(f"{HEADLINE}: {max((ratios[label] for label in micro), default=1.0):.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
