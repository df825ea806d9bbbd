"""Weight sync: seconds to move the policy's weights into the rollout engine(s), from a tiny model to SmolLM2-135M.

For each model a real `PolicyGroup` (DeepSpeed on CPU) and a real `RolloutGroup` (vLLM engines) start on a local
Ray, then the sync paths take turns, `--repeats` times each:
- object store (`--sync.method object_store`): the policy exports its weights to the driver
  (`PolicyActor.export_weights`), which puts them once in Ray's object store, in `--sync.max_chunk_mb` chunks, for
  every engine to reload (`ObjectStoreSync.publish` then `make_current`); the time is export + load, as the trainer
  spends it;
- collective (`--sync.method collective`, what `auto` picks on CPU and GPU): the policy's rank 0 broadcasts every
  tensor to the engines' workers over gloo (`CollectiveSync.update_weights`); the one-off group set-up is
  shown apart.
MB moved = the bytes of the weights (each engine receives all of them). The same run times one rollout batch of the
demo (8 prompts x 4 samples x up to 128 tokens of the built-in task) on the same engines, and shows each sync as a
fraction of it. Before every sync the policy's weights are nudged (seeded noise, 5% of each tensor's mean size), so
every sync has new weights to move; after every sync the engine's and the policy's log-probs of one fixed response
must agree within `MAX_LOGPROB_GAP`, and the gap the engine had before the sync (still holding the previous
weights) is printed beside it: a sync that loaded nothing would keep that gap, far above the bound.

    .venv/bin/python benchmarks/weight_sync.py                           # tiny and SmolLM2-135M-Instruct
    .venv/bin/python benchmarks/weight_sync.py --models tiny --repeats 2 # a quick check

Prints a table and the object store / collective ratio of each model, then `weight_sync_smollm2_s: <median seconds
per sync on the default path, collective>` (for `--models tiny` only: `weight_sync_tiny_s`) as the last line; exits
non-zero when it could not measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
# engine vs policy after a sync, by dtype: fp32 differs by ~1e-6, bf16 SmolLM2 by ~0.01 (CPU)
MAX_LOGPROB_GAP = {"float32": 1e-3, "bfloat16": 0.05}
NUDGE = 0.05  # of each tensor's mean absolute value: moves log-probs by far more than the bound


@dataclass
class Result:
    model: str
    dtype: str
    megabytes: float
    generation_s: float
    seconds: dict[str, list[float]] = field(default_factory=dict)  # path -> seconds per sync
    setup_s: float | None = None  # collective group set-up
    gaps_after: list[float] = field(default_factory=list)  # engine vs policy after each sync
    gaps_before: list[float] = field(default_factory=list)  # the same, just before each sync (stale engine)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny | smollm2 | HF model folders")
    ap.add_argument("--engines", type=int, default=1, help="rollout engines (each receives all the weights)")
    ap.add_argument("--repeats", type=int, default=3, help="timed syncs per path (after one warm-up)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the timed rollout batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt of the timed rollout batch")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--paths", default="auto", help="auto (both) | object_store | collective")
    return ap.parse_args(argv)


def nudge(actor_self, seed: int) -> None:
    """Runs in every policy rank (`__ray_call__`): the same seeded noise on every weight, so each sync moves weights
    the engines do not hold yet. ZeRO-2 keeps full parameters on every rank; nothing trains in this benchmark, so
    the optimizer's own copies never overwrite them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor_self.engine.module.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            p.add_(noise * NUDGE * p.abs().mean())


def measure_model(name: str, args: argparse.Namespace, paths: list[str], tmp: str) -> Result:
    import ray
    from transformers import AutoTokenizer

    from entropy_openrlhf.actors.policy import PolicyGroup
    from entropy_openrlhf.actors.rollout import RolloutGroup
    from entropy_openrlhf.config import from_args
    from entropy_openrlhf.data.arith_task import write_builtin_task
    from entropy_openrlhf.data.dataset import load_prompts
    from entropy_openrlhf.models.builtin import model_folder
    from entropy_openrlhf.sync.collective import CollectiveSync
    from entropy_openrlhf.sync.object_store import ObjectStoreSync

    model_path = model_folder(name, tmp)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, _ = write_builtin_task(Path(tmp) / "data", seed=42, n_train=args.prompts, n_test=1)
    prompts = load_prompts(train, tokenizer=tokenizer)
    longest = max(len(ids) for ids in tokenizer([p.prompt for p in prompts], add_special_tokens=False)["input_ids"])
    cfg = from_args(
        [
            "--model.pretrain", model_path,
            "--rollout.batch_size", str(args.prompts),
            "--rollout.n_samples_per_prompt", str(args.n),
            "--rollout.num_engines", str(args.engines),
            "--rollout.max_model_len", str(longest + args.max_new_tokens),
            "--actor.micro_batch_size", "4",
        ]
    )  # fmt: skip
    policy = PolicyGroup(cfg, model_path)
    rollout = None
    try:
        rollout = RolloutGroup.from_config(cfg, model_path)  # the engines as a run with these flags starts them
        state = policy.call_all("export_weights", timeout_s=600, what="the policy's first export")[0]
        megabytes = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        del state

        rollout_version = [0]  # bumped by every sync
        # the run's settings but a long deadline: a loaded machine must not turn a slow sync into a failure
        syncs = {
            "object_store": ObjectStoreSync(rollout, policy, timeout_s=600, max_chunk_mb=cfg.sync.max_chunk_mb),
            "collective": CollectiveSync(rollout, policy, timeout_s=600, max_chunk_mb=cfg.sync.max_chunk_mb),
        }

        def generate() -> float:
            t0 = time.perf_counter()
            rollout.generate(
                prompts, n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=0,
                policy_version=rollout_version[0],
            )  # fmt: skip
            return time.perf_counter() - t0

        # one fixed response of the model, scored by the engine and by the policy around every sync
        sample = rollout.generate(
            prompts[:1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=1, policy_version=0
        )[0]

        def gap() -> float:
            seq = [sample.prompt_token_ids], [sample.response_token_ids]
            engine_lp = rollout.sequence_log_probs(*seq)[0]
            policy_lp = policy.call_all("forward_log_probs", *seq, timeout_s=600)[0][0]
            return max(abs(a - b) for a, b in zip(engine_lp, policy_lp, strict=True))

        def sync(path: str, check: bool) -> float:
            rollout_version[0] += 1
            ray.get([a.__ray_call__.remote(nudge, rollout_version[0]) for a in policy.actors], timeout=600)
            if check:
                result.gaps_before.append(gap())
            t0 = time.perf_counter()
            if path == "object_store":
                syncs[path].publish(rollout_version[0])
                syncs[path].make_current()
            else:
                syncs[path].update_weights(rollout_version[0])
            seconds = time.perf_counter() - t0
            if check:
                result.gaps_after.append(gap())
            return seconds

        label = name if name in ("tiny", "smollm2") else Path(name).name
        result = Result(label, dtype, megabytes, generation_s=0.0)
        if "collective" in paths:
            t0 = time.perf_counter()
            syncs["collective"].setup()
            result.setup_s = time.perf_counter() - t0
        generate()  # warm-up
        for path in paths:
            sync(path, check=True)  # warm-up, checked too
        result.seconds = {path: [] for path in paths}
        generation = []
        for r in range(args.repeats):
            for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
                result.seconds[path].append(sync(path, check=True))
            generation.append(generate())
        result.generation_s = statistics.median(generation)
        return result
    finally:
        if rollout is not None:
            rollout.shutdown()
        policy.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    load_before = os.getloadavg()[0]
    models = [m for m in args.models.split(",") if m]
    results: list[Result] = []
    tmp = tempfile.TemporaryDirectory(prefix="weight_sync_")
    try:
        import ray

        from entropy_openrlhf.cluster import init_ray

        paths = ["object_store", "collective"] if args.paths == "auto" else [args.paths]
        started = init_ray(num_cpus=8)
        try:
            for name in models:
                results.append(measure_model(name, args, paths, tmp.name))
        finally:
            if started:
                ray.shutdown()
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        print(f"error: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        tmp.cleanup()

    print(
        f"{args.engines} engine(s), 1 policy rank; median of {args.repeats} syncs per path, paths interleaved; "
        f"rollout batch {args.prompts} prompts x {args.n} samples x <= {args.max_new_tokens} tokens"
    )
    print(machine_line(load_before))
    header = f"{'model':<10}{'dtype':<10}{'path':<14}{'MB':>8}{'s/sync':>9}{'MB/s':>9}{'gen s':>8}{'sync/gen':>10}"
    print(header + f"{'setup s':>9}")
    for r in results:
        for path, seconds in r.seconds.items():
            s = statistics.median(seconds)
            setup = f"{r.setup_s:9.2f}" if path == "collective" and r.setup_s is not None else f"{'':>9}"
            rate = r.megabytes * args.engines / s
            print(
                f"{r.model:<10}{r.dtype:<10}{path:<14}{r.megabytes:>8.1f}{s:>9.3f}{rate:>9.0f}"
                f"{r.generation_s:>8.2f}{s / r.generation_s:>10.3f}{setup}"
            )
    for r in results:
        print(
            f"{r.model}: max |engine - policy| log-prob after each of {len(r.gaps_after)} syncs: "
            f"{max(r.gaps_after):.2e} (bound {MAX_LOGPROB_GAP[r.dtype]:g}); just before each, with the new "
            f"weights not yet synced: at least {min(r.gaps_before):.2e}"
        )
        if {"object_store", "collective"} <= set(r.seconds):
            ratio = statistics.median(r.seconds["object_store"]) / statistics.median(r.seconds["collective"])
            print(f"{r.model}: object store / collective seconds per sync: {ratio:.2f}")
    # every sync loaded the new weights, and the check could tell: a stale engine was far outside the bound
    bad = [r.model for r in results if not (max(r.gaps_after) <= MAX_LOGPROB_GAP[r.dtype] < min(r.gaps_before))]
    if bad:
        print(f"error: the engines do not hold the policy's weights after a sync ({', '.join(bad)})", file=sys.stderr)
        return 1
    head = next((r for r in results if r.model == "smollm2"), results[-1])
    if "collective" not in head.seconds:
        print(f"weight_sync_{head.model}_s: not measured (the default path, collective, was not run)")
        return 1
    print(f"weight_sync_{head.model}_s: {statistics.median(head.seconds['collective']):.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
