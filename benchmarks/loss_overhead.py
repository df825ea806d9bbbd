"""Loss overhead: what Clip-Cov and KL-Cov cost on top of PPO, in a full policy train step and in the loss alone.

Table 1 is the real thing: one `PolicyGroup` (a Ray actor with DeepSpeed on CPU) trains on the same fixed batch
with ppo, clip_cov and kl_cov, the last two with both selection scopes (`--loss.scope micro_batch | global`). The
variants share the one actor (its loss settings are switched between steps), take turns within every repeat (the
order rotates), and each step is timed inside the actor (`time/train_actor`: old log-probs, every mini-batch's
forward, loss, backward and optimizer step). The ratio column is the median over repeats of (variant step / the
ppo step of the same repeat), so slow drifts of a shared machine cancel.

Table 2 times the loss functions alone (forward + backward of `algorithms/losses.py`, plus the global selection
over a mini-batch for the global scope) on shapes from the demo's micro-batch to the paper's, since the step is
dominated by the model's forward and backward.

    .venv/bin/python benchmarks/loss_overhead.py                    # SmolLM2-135M-Instruct, the demo's batch
    .venv/bin/python benchmarks/loss_overhead.py --model tiny       # a tiny random model: a quick check

Prints both tables, then `loss_overhead_max_ratio: <the largest step ratio to ppo>` as the last line (target:
1.05 or less); exits non-zero when it could not measure.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = "loss_overhead_max_ratio"
# (name, loss.type, loss.scope); ppo ignores the scope
VARIANTS = [
    ("ppo", "ppo", "micro_batch"),
    ("clip_cov micro_batch", "clip_cov", "micro_batch"),
    ("clip_cov global", "clip_cov", "global"),
    ("kl_cov micro_batch", "kl_cov", "micro_batch"),
    ("kl_cov global", "kl_cov", "global"),
]
# loss-alone shapes (micro-batch rows x response tokens, micro-batches per mini-batch)
SHAPES = [(4, 128, 4), (4, 1024, 4), (2, 8192, 8)]


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


def set_loss(actor_self, loss_type: str, scope: str) -> None:
    """Runs inside the policy actor (`__ray_call__`): switches the loss of its next train_step."""
    lc = actor_self.cfg.loss
    lc.type, lc.scope = loss_type, scope
    # the paper's Clip-Cov widens PPO's clip to 1 (presets.PIPELINES); PPO and KL-Cov keep 0.2
    lc.clip_low = lc.clip_high = 1.0 if loss_type == "clip_cov" else 0.2


def time_steps(args, model_path: str) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Seconds per train step of each variant over the repeats, and each variant's last step metrics."""
    import ray

    from entropy_openrlhf.actors.policy import PolicyGroup
    from entropy_openrlhf.config import from_args, validate

    cfg = from_args(
        [
            "--model.dtype", args.dtype,
            "--rollout.batch_size", str(args.samples // 4),
            "--rollout.n_samples_per_prompt", "4",
            "--actor.micro_batch_size", str(args.micro_batch),
            "--train.mini_batches", str(args.mini_batches),
            "--actor.lr", "1e-7",  # the weights barely move: every step sees nearly the same model
        ]
    )  # fmt: skip
    validate(cfg)
    from transformers import AutoConfig

    batch = fixed_batch(args, AutoConfig.from_pretrained(model_path).vocab_size)
    group = PolicyGroup(cfg, model_path)
    actors = group.actors
    times: dict[str, list[float]] = {name: [] for name, *_ in VARIANTS}
    last: dict[str, dict[str, float]] = {}
    step = 0
    try:
        for r in range(args.repeats + 1):  # repeat 0 is the warm-up
            k = r % len(VARIANTS)
            for name, loss_type, scope in VARIANTS[k:] + VARIANTS[:k]:
                ray.get([a.__ray_call__.remote(set_loss, loss_type, scope) for a in actors])
                metrics = group.train_step(batch, step)
                step += 1
                if r > 0:
                    times[name].append(metrics["time/train_actor"])
                    last[name] = metrics
                print(f"  repeat {r} {name:<22} {metrics['time/train_actor']:7.2f} s", file=sys.stderr, flush=True)
    finally:
        group.shutdown()
    return times, last


def paired_ratios(times: dict[str, list[float]]) -> dict[str, float]:
    base = times["ppo"]
    return {name: statistics.median(t / b for t, b in zip(ts, base)) for name, ts in times.items()}


def make_mini_batch(rows: int, length: int, micro_per_mini: int, seed: int = 0) -> list:
    """Synthetic micro-batches of one optimizer mini-batch: sampled-token log-probs, a slightly older policy's,
    one advantage per row, and the last 20 % of every row padding."""
    import torch

    from entropy_openrlhf.algorithms.selection import MicroBatch

    gen = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(micro_per_mini):
        lp = -torch.rand(rows, length, generator=gen) * 12
        old = lp + torch.randn(rows, length, generator=gen) * 0.05
        adv = torch.randn(rows, 1, generator=gen).expand(rows, length).contiguous()
        mask = torch.ones(rows, length)
        mask[:, int(length * 0.8) :] = 0
        micro.append(MicroBatch(lp, old, adv, mask))
    return micro


def run_mini_batch(micro: list, loss_type: str, scope: str) -> None:
    """What the trainer does per mini-batch: for the global scope one selection over all micro-batches, then each
    micro-batch's loss forward and backward (normalised over the whole mini-batch)."""
    import torch

    from entropy_openrlhf.algorithms.losses import clip_cov_loss, kl_cov_loss, ppo_loss
    from entropy_openrlhf.algorithms.selection import global_selection

    n = sum(float(mb.mask.sum()) for mb in micro)
    ratio = {"clip_cov": 2e-4, "kl_cov": 2e-3}.get(loss_type, 0.0)  # the paper's
    masks, means = [None] * len(micro), None
    if scope == "global" and loss_type != "ppo":
        masks, means = global_selection(micro, loss_type, ratio=ratio, generator=torch.Generator().manual_seed(1))
    for i, mb in enumerate(micro):
        x = mb.log_probs.clone().requires_grad_(True)
        args = (x, mb.old_log_probs, mb.advantages, mb.mask)
        if loss_type == "ppo":
            out = ppo_loss(*args, normalizer=n)
        elif loss_type == "clip_cov":
            g = torch.Generator().manual_seed(i)
            out = clip_cov_loss(*args, ratio=ratio, normalizer=n, generator=g, selected=masks[i], cov_means=means)
        else:
            out = kl_cov_loss(*args, ratio=ratio, normalizer=n, selected=masks[i], cov_means=means)
        out.loss.backward()


def time_losses(repeats: int, threads: int) -> list[tuple[str, str, float, float]]:
    """(shape, variant, median ms per mini-batch, ratio to ppo) for every shape; the variants take turns.

    One thread by default: on a shared 2-core machine torch's thread pool waits for cores other processes hold, and
    these small element-wise ops then vary 10-20x between runs; a single thread keeps the comparison steady."""
    import torch

    torch.set_num_threads(threads)
    rows = []
    for rows_per_micro, length, micro_per_mini in SHAPES:
        micro = make_mini_batch(rows_per_micro, length, micro_per_mini)
        seconds: dict[str, list[float]] = {name: [] for name, *_ in VARIANTS}
        for r in range(repeats + 2):  # 2 warm-up rounds
            for name, loss_type, scope in VARIANTS:
                t0 = time.perf_counter()
                run_mini_batch(micro, loss_type, scope)
                if r >= 2:
                    seconds[name].append(time.perf_counter() - t0)
        base = statistics.median(seconds["ppo"])
        for name, ts in seconds.items():
            med = statistics.median(ts)
            rows.append((f"{micro_per_mini}x{rows_per_micro}x{length}", name, med * 1000, med / base))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    load_before = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory(prefix="loss_overhead_")
    try:
        loss_rows = time_losses(args.loss_repeats, args.loss_threads)
        times, last = {}, {}
        if not args.skip_step:
            import ray

            from entropy_openrlhf.cluster import init_ray
            from entropy_openrlhf.models import model_folder

            model_path = model_folder(args.model, tmp.name)
            started = init_ray(num_cpus=8)
            try:
                times, last = time_steps(args, model_path)
            finally:
                if started:
                    ray.shutdown()
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        print(f"error: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        tmp.cleanup()

    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; load average (1 min) before / after: "
          f"{load_before:.1f} / {os.getloadavg()[0]:.1f}")  # fmt: skip
    if times:
        print(
            f"\nfull policy train step: model {args.model} ({args.dtype}), {args.samples} sequences x "
            f"({args.prompt_len} prompt + <= {args.response_len} response) tokens, micro-batch {args.micro_batch}, "
            f"{args.mini_batches} mini-batches, 1 DeepSpeed rank; median of {args.repeats} interleaved repeats"
        )
        ratios = paired_ratios(times)
        print(f"{'variant':<22}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio to ppo':>14}{'selected frac':>15}")
        for name, ts in times.items():
            m = last[name]
            frac = m.get("loss/clip_cov_frac", m.get("loss/kl_cov_frac", 0.0))
            print(
                f"{name:<22}{statistics.median(ts):>10.2f}{min(ts):>8.2f}{max(ts):>8.2f}{ratios[name]:>14.3f}"
                f"{frac:>15.4f}"
            )
    print(
        f"\nloss functions alone, per optimizer mini-batch (micro-batches x rows x tokens, 20 % padding): every "
        f"micro-batch's loss forward + backward, and for the global scope the one selection; median of "
        f"{args.loss_repeats}, {args.loss_threads} torch thread(s)"
    )
    print(f"{'shape':<14}{'variant':<22}{'median ms':>10}{'ratio to ppo':>14}")
    for shape, name, ms, ratio in loss_rows:
        print(f"{shape:<14}{name:<22}{ms:>10.2f}{ratio:>14.2f}")
    if not times:
        print(f"{HEADLINE}: not measured (--skip-step)")
        return 1
    if any(len(ts) != args.repeats or min(ts) <= 0 for ts in times.values()):
        print(f"error: could not measure: a variant has {min(len(t) for t in times.values())} timed steps")
        return 1
    print(f"{HEADLINE}: {max(ratios.values()):.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
