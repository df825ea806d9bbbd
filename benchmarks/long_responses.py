"""Memory and time of one policy train step on long responses, micro-batched by a token budget, on one device.

The step is the trainer's own (the engine builder of actors/policy_engine.py and the phases of
actors/train_phases.py that a policy rank runs: the no-grad pass for old log-probs, then forward, KL-Cov loss and
backward per micro-batch, and the optimizer step), on a one-rank process group with bf16, ZeRO-3 and gradient
checkpointing, as the 7B and 32B presets run it. No Ray, no vLLM, no download: the model is built here with random
weights in the shape of a public one (its vocabulary is what matters for long responses: the trainer materialises
each micro-batch's response logits over the whole vocabulary, in fp32 for the log-softmax).

For each response length L: one prompt of `--prompt-len` random tokens with `--responses` responses of L random
tokens, micro-batches of at most `--budget` tokens (default: one prompt and one response). It prints, per length,
the micro-batches and the response tokens of the largest, the step's time, its peak device memory above the memory
the model and optimizer hold before it (CUDA only: torch's peak allocated bytes), and what the largest micro-batch's
fp32 response logits take (tokens x vocab x 4 bytes), which that peak is compared with.

    python benchmarks/long_responses.py --arch qwen2.5-0.5b --lengths 1024,4096,8192,16384    # a GPU
    python benchmarks/long_responses.py --device cpu --arch tiny --lengths 64,128               # its CPU twin (CI)

With `--head-chunks 0,2048` each length runs with the whole output head and with the head in chunks of 2048
response tokens (`--train.head_chunk_tokens`), on the same tokens.

The last line is `long_responses_peak_gib: <the step's peak above the model's memory in the last row>` (the longest
length with the last head chunk; on the CPU, where torch keeps no peak, the process's resident high-water mark).
Exits non-zero when a step was not applied or its loss was not finite.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = "long_responses_peak_gib"
GIB = 2**30
# the shapes of public models (their config.json), built with random weights: no download
ARCHS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # one narrow layer with Qwen's vocabulary: the logits are nearly all of a step's memory, and a CPU runs it
    "tiny-152k": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--arch", default="qwen2.5-0.5b", help=f"tiny | {' | '.join(ARCHS)} | an HF model folder")
    ap.add_argument("--lengths", default="1024,4096,8192,16384", help="response lengths, comma-separated, ascending")
    ap.add_argument("--responses", type=int, default=4, help="responses per step (one prompt)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--budget", type=int, default=0, help="tokens per micro-batch; 0 = one prompt and one response")
    ap.add_argument("--zero-stage", type=int, choices=(2, 3), default=3)
    ap.add_argument(
        "--head-chunks",
        default="0",
        help="--train.head_chunk_tokens values to run each length with, comma-separated (0 = whole)",
    )
    args = ap.parse_args(argv)
    try:
        args.head_chunks = [int(x) for x in args.head_chunks.split(",")]
    except ValueError:
        ap.error(f"--head-chunks {args.head_chunks!r}: comma-separated integers")
    if min(args.head_chunks) < 0:
        ap.error(f"--head-chunks {args.head_chunks}: each >= 0 (0 = the whole head)")
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths {args.lengths!r}: comma-separated integers")
    if args.lengths != sorted(args.lengths) or min(args.lengths) < 1:
        ap.error(f"--lengths {args.lengths}: positive and ascending (the peak is reset before each)")
    if args.arch not in ("tiny", *ARCHS) and not (Path(args.arch) / "config.json").is_file():
        ap.error(f"--arch {args.arch}: tiny, {', '.join(ARCHS)} or an HF model folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # DeepSpeed picks its accelerator when imported, and the CPU twin must see no GPU: set before the imports below
    os.environ["DS_ACCELERATOR"] = args.device
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from entropy_openrlhf.actors.chunked_head import use_chunked_head
    from entropy_openrlhf.actors.micro_batches import layout_for
    from entropy_openrlhf.actors.policy_engine import build_policy_engine
    from entropy_openrlhf.actors.step_data import TrainSample
    from entropy_openrlhf.actors.train_phases import (
        RankSetup,
        old_log_probs,
        optimizer_step,
        prepare_step,
        response_log_probs,
        step_result,
    )
    from entropy_openrlhf.config import from_args
    from entropy_openrlhf.gpu_check.zero import start_process_group
    from entropy_openrlhf.models.tiny import make_tiny_model

    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    bf16 = dev.type == "cuda"  # fp32 on CPU (bf16 is ~60x slower on CPUs without AMX)
    start_process_group(dev)
    n, longest = args.responses, args.lengths[-1]
    budget = args.budget or args.prompt_len + longest
    flags = [
        "--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", str(n), "--train.mini_batches", "1",
        "--actor.micro_batch_size", "1", "--train.max_tokens_per_micro_batch", str(budget),
        "--rollout.max_new_tokens", str(longest),
        "--train.num_steps", str((len(args.lengths) + 1) * len(args.head_chunks)),
        "--actor.zero_stage", str(args.zero_stage), "--actor.gradient_checkpointing", "true",
        "--model.dtype", "bf16" if bf16 else "fp32", "--actor.lr", "1e-6",
        # KL-Cov as the 7B and 32B presets run it: tokens selected over the whole mini-batch
        "--loss.type", "kl_cov", "--loss.scope", "global", "--loss.kl_cov.ratio", "2e-3",
        "--train.shared_prefix", "off", "--ref.enabled", "false", "--async.max_staleness", "0",
    ]  # fmt: skip
    cfg = from_args(flags)

    with tempfile.TemporaryDirectory(prefix="long_responses_") as tmp:
        if args.arch == "tiny":
            path = str(make_tiny_model(Path(tmp) / "tiny"))
        elif args.arch in ARCHS:
            config = AutoConfig.for_model("qwen2", max_position_embeddings=32768, rope_theta=1e6,
                                          pad_token_id=0, **ARCHS[args.arch])  # fmt: skip
            with dev:  # random weights made on the device: seconds on a GPU for a 1.5B model
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if bf16 else torch.float32)
            model.save_pretrained(Path(tmp) / args.arch)
            del model
            path = str(Path(tmp) / args.arch)
        else:
            path = args.arch
        built = build_policy_engine(cfg, path, world_size=1)
        engine, vocab = built.engine, built.engine.module.config.vocab_size
        setup = RankSetup(cfg, 0, 1, built.pad_id)
        held = torch.cuda.memory_allocated(dev) if bf16 else 0
        where = torch.cuda.get_device_name(dev) if bf16 else f"CPU {cpu_model()}"
        params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())  # ZeRO-3: partitioned
        print(f"[long-responses] {where}; {args.arch} ({params / 1e9:.2f}B parameters, vocab {vocab}), "
              f"{'bf16' if bf16 else 'fp32'}, ZeRO-{args.zero_stage}, gradient checkpointing; {n} responses of each "
              f"length after a {args.prompt_len}-token prompt, micro-batches of at most {budget} tokens; model and "
              f"optimizer hold {held / GIB:.2f} GiB", flush=True)  # fmt: skip

        def step(length: int, chunk: int, index: int) -> dict[str, float]:
            use_chunked_head(engine.module, chunk)
            rng = random.Random(length)  # the same tokens for every head chunk at this length
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            rows = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]
            # the rollout's log-probs: the starting weights' (on-policy), one response at a time
            samples = [
                TrainSample(prompt, r, 1.0 if j % 2 else -1.0, response_log_probs(setup, engine, [prompt], [r])[0])
                for j, r in enumerate(rows)
            ]
            layout = layout_for([len(prompt) + length] * n, [tuple(prompt)] * n, 1, 1, 1, budget, keep_groups=False)
            if bf16:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.monotonic()
            s = prepare_step(setup, engine, samples, index, 1.0, None, layout.sizes(0))
            old_log_probs(setup, engine, s, range(len(s.batches)))
            engine.train()
            applied = optimizer_step(setup, engine, s, 0, False)
            if bf16:
                torch.cuda.synchronize(dev)
            seconds = time.monotonic() - t0
            result = step_result(s, world_size=1, skipped=int(not applied), lr=s.lr, seconds=seconds)
            if bf16:
                peak = torch.cuda.max_memory_allocated(dev) - held
            else:  # torch keeps no peak on the CPU: the process's resident high-water mark, model included
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return {"micro": len(s.batches), "tokens": max(int(b.mask.sum()) for b in s.batches), "seconds": seconds,
                    "peak": peak, "applied": applied, "loss": result["loss/policy"]}  # fmt: skip

        for chunk in args.head_chunks:  # warm-up: kernels and allocator pools, neither timed nor counted
            step(args.lengths[0], chunk, 0)
        print(f"{'length':>7} {'head chunk':>10} {'micro-batches':>13} {'largest':>8} {'step s':>8} {'tokens/s':>9} "
              f"{'peak GiB':>9} {'logits GiB':>10} {'peak/logits':>11}", flush=True)  # fmt: skip
        ok, peak = True, math.nan
        runs = [(length, chunk) for length in args.lengths for chunk in args.head_chunks]
        for i, (length, chunk) in enumerate(runs, start=1):
            r = step(length, chunk, i)
            logits = r["tokens"] * vocab * 4 / GIB  # one micro-batch's response logits in fp32
            peak = r["peak"] / GIB
            print(f"{length:>7} {chunk:>10} {r['micro']:>13} {r['tokens']:>8} {r['seconds']:>8.2f} "
                  f"{n * length / r['seconds']:>9.0f} {peak:>9.2f} {logits:>10.2f} {peak / logits:>11.2f}",
                  flush=True)  # fmt: skip
            ok = ok and r["applied"] and math.isfinite(r["loss"])
        engine.destroy()
    torch.distributed.destroy_process_group()
    if not ok:
        print("[long-responses] a step was skipped or its loss was not finite", flush=True)
        return 1
    print(f"{HEADLINE}: {peak:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
