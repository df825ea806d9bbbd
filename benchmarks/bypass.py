"""Bypass mode: the policy's train step with `--offpolicy.bypass true` (pi_old = the rollout's log-probs, no
old-log-prob forward) against the default recompute path (the no-grad old pass, token TIS), on the same batches.

One `PolicyGroup` (a Ray actor with DeepSpeed on CPU) trains on one fixed batch with both settings; they share the
actor (its `--offpolicy.*` section is replaced between steps), take turns within every repeat (the order alternates),
and each step is timed inside the actor (`time/train_actor`: old log-probs when they run, every mini-batch's
forward, loss, backward and optimizer step). The ratio is the median over repeats of (bypass step / the recompute
step of the same repeat), so slow drifts of a shared machine cancel.

What bypass saves depends on the model: a dropout-free model already takes the first mini-batch's old log-probs
from its training forward, so recompute runs the no-grad pass over the other (mini_batches - 1) / mini_batches of the
batch; bypass skips that and instead computes the token entropies (a metric) in every training forward.

    .venv/bin/python benchmarks/bypass.py                        # a tiny random model (about a minute)
    .venv/bin/python benchmarks/bypass.py --model smollm2        # SmolLM2-135M-Instruct, the demo's batch

Prints the table, then `bypass_step_ratio: <median bypass / recompute>` as the last line; exits non-zero when it
could not measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from loss_overhead import fixed_batch as loss_overhead_batch  # the scripts' folder is on sys.path
from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

# torch, Ray, transformers and the package are imported inside the functions that use them: `--help` stays fast.

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = "bypass_step_ratio"
# the two settings, as --offpolicy flags on top of the run's: the default (legacy token TIS on an async run) and bypass
VARIANTS = {"recompute": [], "bypass": ["--offpolicy.bypass", "true"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | an HF model folder")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, else the checkpoint's) | bf16 | fp32")
    ap.add_argument("--samples", type=int, default=32, help="sequences in the batch (demo: 8 prompts x 4)")
    ap.add_argument("--prompt-len", type=int, default=160, help="prompt tokens per sequence")
    ap.add_argument("--response-len", type=int, default=128, help="response tokens per sequence (at most)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per batch")
    ap.add_argument("--loss", default="kl_cov", help="--loss.type of both variants")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per variant, after one warm-up each")
    return ap.parse_args(argv)


def fixed_batch(args, vocab: int, seed: int = 0):
    """loss_overhead.py's GRPO-shaped samples (the same draws, rollout log-probs near -8 as a random model's would
    be), half of them one version stale."""
    samples = loss_overhead_batch(args, vocab, seed)
    for i, s in enumerate(samples):
        s.staleness = i % 2
    return samples


def set_offpolicy(actor_self, section) -> None:
    """Runs inside the policy actor (`__ray_call__`): the --offpolicy.* settings of its next train_step (the actor
    and its RankSetup share the one Config)."""
    actor_self.cfg.offpolicy = section


def time_steps(args, model_path: str) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Seconds per train step of each variant over the repeats, and each variant's last step metrics."""
    import ray
    from transformers import AutoConfig

    from entropy_openrlhf.actors.policy import PolicyGroup
    from entropy_openrlhf.config import from_args, validate

    flags = [
        "--model.dtype", args.dtype,
        "--loss.type", args.loss,
        "--rollout.batch_size", str(args.samples // 4),
        "--rollout.n_samples_per_prompt", "4",
        "--actor.micro_batch_size", str(args.micro_batch),
        "--train.mini_batches", str(args.mini_batches),
        "--actor.lr", "1e-7",  # the weights barely move: every step sees nearly the same model
    ]  # fmt: skip
    configs = {name: from_args([*flags, *extra]) for name, extra in VARIANTS.items()}
    for cfg in configs.values():
        validate(cfg)  # raises on settings that cannot work
    batch = fixed_batch(args, AutoConfig.from_pretrained(model_path).vocab_size)
    group = PolicyGroup(configs["recompute"], model_path)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, dict[str, float]] = {}
    step = 0
    try:
        for r in range(args.repeats + 1):  # repeat 0 is the warm-up
            for name in names if r % 2 == 0 else names[::-1]:
                settings = configs[name].offpolicy
                ray.get([a.__ray_call__.remote(set_offpolicy, settings) for a in group.actors], timeout=120)
                metrics = group.train_step(batch, step)
                step += 1
                if r > 0:
                    times[name].append(metrics["time/train_actor"])
                    last[name] = metrics
                print(f"  repeat {r} {name:<10} {metrics['time/train_actor']:7.2f} s", file=sys.stderr, flush=True)
    finally:
        group.shutdown()
    return times, last


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    load_before = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory(prefix="bypass_")
    try:
        import ray

        from entropy_openrlhf.cluster import init_ray
        from entropy_openrlhf.models.builtin import model_folder

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

    if any(len(ts) != args.repeats or min(ts) <= 0 for ts in times.values()):
        print(f"error: could not measure: {min(len(t) for t in times.values())} timed steps of {args.repeats}")
        return 1
    print(machine_line(load_before))
    print(
        f"\npolicy train step, {args.loss}: model {args.model} ({args.dtype}), {args.samples} sequences x "
        f"({args.prompt_len} prompt + <= {args.response_len} response) tokens, micro-batch {args.micro_batch}, "
        f"{args.mini_batches} mini-batches, 1 DeepSpeed rank; median of {args.repeats} interleaved repeats"
    )
    ratios = [b / r for b, r in zip(times["bypass"], times["recompute"])]
    print(f"{'variant':<12}{'median s':>10}{'min s':>8}{'max s':>8}{'old-pass micro-batches':>24}")
    for name, ts in times.items():
        passes = last[name]["train/old_pass_micro_batches"]
        print(f"{name:<12}{statistics.median(ts):>10.2f}{min(ts):>8.2f}{max(ts):>8.2f}{passes:>24.0f}")
    print(f"\nper repeat, bypass / recompute: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"{HEADLINE}: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
