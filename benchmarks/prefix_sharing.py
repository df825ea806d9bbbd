"""Shared-prefix packing: the full policy train step and the reference pass with `--train.shared_prefix` off, on
and auto, side by side.

One `PolicyGroup` (a Ray actor, DeepSpeed on CPU) and one `ReferenceGroup` serve every variant; the variant is
switched inside the actors between steps (the mode and the model's attention implementation). The variants take
turns within every repeat (the order rotates) and each step is timed inside the actor (`time/train_actor`: old
log-probs, then every mini-batch's forward, backward and optimizer step); the reference pass is timed around its
call. Ratios are medians over repeats of (off / variant) within the same repeat, so slow drifts of a shared machine
cancel.

Two shapes, GRPO-like (groups of 4 or 8 responses share a prompt):
- demo: 4 prompts x 4 responses, 360-token prompts, answers of ~28 tokens, micro-batch 4 (the demo's);
- long: 1 prompt of 128 tokens x 8 responses of ~512, micro-batch 8: where sharing stops paying, and `auto` must
  be no slower than off.

    .venv/bin/python benchmarks/prefix_sharing.py                 # SmolLM2-135M-Instruct, both shapes
    .venv/bin/python benchmarks/prefix_sharing.py --model tiny    # a quick check

Prints a table per shape, then `prefix_sharing_step_speedup: <off / auto on the demo shape>` as the last line
(target 2.5 or more); exits non-zero when it could not measure.
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

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = "prefix_sharing_step_speedup"
MODES = ("off", "on", "auto")
# name: (prompts, responses per prompt, prompt tokens, response tokens (mean), micro-batch)
SHAPES = {"demo": (4, 4, 360, 28, 4), "long": (1, 8, 128, 512, 8)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | an HF model folder")
    ap.add_argument("--shapes", default="demo,long", help="comma-separated: demo, long")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per variant, after one warm-up round")
    return ap.parse_args(argv)


def make_batch(shape: str, vocab: int, seed: int = 0):
    from entropy_openrlhf.actors.policy import TrainSample

    prompts, n, p_len, r_len, _ = SHAPES[shape]
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(p_len)]
        for k in range(n):
            length = rng.randint(r_len * 3 // 4, r_len * 5 // 4)
            response = [rng.randrange(3, vocab) for _ in range(length)]
            out.append(TrainSample(prompt, response, (-1.0) ** k, [-8.0 + rng.gauss(0, 0.05) for _ in range(length)]))
    return out


def set_mode(actor_self, mode: str) -> None:
    """Runs inside the policy or reference actor (`__ray_call__`): the packing mode of its next batches, and the
    attention implementation it needs (packed batches need "prefix_split", plain ones run on SDPA)."""
    from entropy_openrlhf.actors.prefix_packing import ATTENTION_NAME, register

    register()
    model = actor_self.engine.module if hasattr(actor_self, "engine") else actor_self.ref.model
    model.set_attn_implementation("sdpa" if mode == "off" else ATTENTION_NAME)
    if hasattr(actor_self, "cfg"):
        actor_self.cfg.train.shared_prefix = mode
    else:
        actor_self.shared_prefix = mode


def time_shape(shape: str, model_path: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{mode: {"step": [...], "reference": [...]}} seconds over the timed repeats."""
    import ray
    from transformers import AutoConfig

    from entropy_openrlhf.actors.policy import PolicyGroup
    from entropy_openrlhf.actors.reference import ReferenceGroup
    from entropy_openrlhf.config import from_args, validate

    prompts, n, _, _, micro = SHAPES[shape]
    cfg = from_args(
        [
            "--rollout.batch_size", str(prompts),
            "--rollout.n_samples_per_prompt", str(n),
            "--actor.micro_batch_size", str(micro),
            "--train.mini_batches", "2",
            "--actor.lr", "1e-7",  # the weights barely move: every step sees nearly the same model
        ]
    )  # fmt: skip
    validate(cfg)
    batch = make_batch(shape, AutoConfig.from_pretrained(model_path).vocab_size)
    group = PolicyGroup(cfg, model_path)
    reference = ReferenceGroup(cfg, model_path)  # as training runs it: one rank, the policy's micro-batch
    times: dict[str, dict[str, list[float]]] = {m: {"step": [], "reference": []} for m in MODES}
    step = 0
    try:
        for r in range(repeats + 1):  # repeat 0 warms every variant up
            k = r % len(MODES)
            for mode in MODES[k:] + MODES[:k]:
                ray.get([a.__ray_call__.remote(set_mode, mode) for a in group.actors], timeout=120)
                ray.get([a.__ray_call__.remote(set_mode, mode) for a in reference.actors], timeout=120)
                metrics = group.train_step(batch, step)
                step += 1
                t0 = time.perf_counter()
                reference.log_probs([s.prompt_ids for s in batch], [s.response_ids for s in batch])
                ref_s = time.perf_counter() - t0
                if r > 0:
                    times[mode]["step"].append(metrics["time/train_actor"])
                    times[mode]["reference"].append(ref_s)
                print(f"  {shape} repeat {r} {mode:<5} step {metrics['time/train_actor']:7.2f} s, reference "
                      f"{ref_s:6.2f} s", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        group.shutdown()
        reference.shutdown()
    return times


def paired(times: dict[str, dict[str, list[float]]], part: str, mode: str) -> float:
    """Median over repeats of off / mode for one part (step or reference)."""
    return statistics.median(o / m for o, m in zip(times["off"][part], times[mode][part]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"error: --shapes: unknown {unknown}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory(prefix="prefix_sharing_")
    results = {}
    try:
        import ray

        from entropy_openrlhf.cluster import init_ray
        from entropy_openrlhf.models.builtin import model_folder

        model_path = model_folder(args.model, tmp.name)
        started = init_ray(num_cpus=8)
        try:
            for shape in shapes:
                results[shape] = time_shape(shape, model_path, args.repeats)
        finally:
            if started:
                ray.shutdown()
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        print(f"error: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        tmp.cleanup()

    print(machine_line(load_before))
    for shape, times in results.items():
        prompts, n, p_len, r_len, micro = SHAPES[shape]
        print(f"\n{shape}: model {args.model}, {prompts} prompt(s) x {n} responses, {p_len}-token prompts, responses "
              f"of ~{r_len} tokens, micro-batch {micro}, 2 mini-batches; median of {args.repeats} interleaved "
              "repeats")  # fmt: skip
        print(f"{'shared_prefix':<14}{'step s':>9}{'speed-up':>10}{'reference s':>13}{'speed-up':>10}")
        for mode in MODES:
            t = times[mode]
            print(f"{mode:<14}{statistics.median(t['step']):>9.2f}{paired(times, 'step', mode):>10.2f}"
                  f"{statistics.median(t['reference']):>13.2f}{paired(times, 'reference', mode):>10.2f}")  # fmt: skip
    if "demo" not in results:
        print(f"{HEADLINE}: not measured (the demo shape was not run)")
        return 1
    print(f"{HEADLINE}: {paired(results['demo'], 'step', 'auto'):.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
