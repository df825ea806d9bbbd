"""Where a model's token covariances sit against Clip-Cov's bounds, on its own rollouts: the numbers behind a
Clip-Cov setting (docs/algorithms/losses.md, "Clip-Cov at small scale").

    .venv/bin/python study/covariance_profile.py                     # SmolLM2-135M-Instruct, built-in task
    .venv/bin/python study/covariance_profile.py --prompts 64 --micro-batch 4 --json profile.json

Samples `--n` responses for each of `--prompts` training prompts with vLLM (in this process, T = 1, the sampled
token's log-prob from the engine: at the start of a step the current policy is the old one), scores them with the
math verifier, takes GRPO advantages and, per micro-batch of `--micro-batch` responses as the trainer cuts them,
the token covariance c = (A - mean A)(logp - mean logp) Clip-Cov and KL-Cov select on. Prints:
- quantiles of c, and the share of tokens in (lb, ub) for the paper's absolute bounds (1, 5);
- per micro-batch: valid tokens, candidates in (1, 5), Clip-Cov's quota max(1, floor(ratio * N)) for ratios;
- where the positive covariance mass is: tokens with A > 0 (confident tokens of right answers) against A < 0
  (rare tokens of wrong answers), and the share the top 1 / 2 / 5 % of tokens by c carry;
- the same in units of the micro-batch's covariance standard deviation (the scale-free bounds).
"""

from __future__ import annotations

import argparse
import json
import sys

import entropy_openrlhf  # noqa: F401  (first: the loopback environment)
from entropy_openrlhf.cluster import set_cpu_defaults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain", default="", help="an HF folder; empty: the built-in SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (the GRPO group)")
    parser.add_argument("--micro-batch", type=int, default=4, help="responses per micro-batch")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the numbers here")
    args = parser.parse_args(argv)

    set_cpu_defaults()
    import torch  # after the CPU settings: vLLM and torch read them at import (module docstring of cluster.py)
    from vllm import LLM, SamplingParams

    from entropy_openrlhf.algorithms.advantages import compute_advantages
    from entropy_openrlhf.algorithms.losses import token_covariance
    from entropy_openrlhf.config import from_args
    from entropy_openrlhf.pipeline.main import prepare
    from rewards.math import math_verifier

    cfg = from_args(["--model.pretrain", args.pretrain, "--train.output_dir", "/tmp/covariance_profile"])
    model_path, train_items, _ = prepare(cfg)
    items = train_items[: args.prompts]
    llm = LLM(model=model_path, dtype="float32", seed=args.seed, enforce_eager=True, max_model_len=2048)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, logprobs=0)  # LLM(seed=)
    outputs = llm.generate([p.prompt for p in items], params, use_tqdm=False)

    rewards, group_ids, logps = [], [], []
    for i, (item, out) in enumerate(zip(items, outputs)):
        for completion in out.outputs:
            rewards.append(float(math_verifier(completion.text, item.label)["reward"]))
            group_ids.append(i)
            logps.append([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
    adv = compute_advantages(torch.tensor(rewards), torch.tensor(group_ids), "grpo")

    ratios = (2e-4, 2e-3, 2e-2, 5e-2)
    cov_all, sign_all, z_all, per_micro = [], [], [], []
    for start in range(0, len(logps), args.micro_batch):
        rows = logps[start : start + args.micro_batch]
        width = max(len(r) for r in rows)
        lp = torch.zeros(len(rows), width)
        mask = torch.zeros(len(rows), width)
        for j, r in enumerate(rows):
            lp[j, : len(r)] = torch.tensor(r)
            mask[j, : len(r)] = 1
        a = adv[start : start + len(rows)].unsqueeze(1).expand(-1, width) * mask
        c = token_covariance(lp, a, mask)[mask.bool()]
        std = float(c.std()) if c.numel() > 1 else 0.0
        cov_all.append(c)
        sign_all.append(a[mask.bool()])
        z_all.append(c / std if std > 0 else torch.zeros_like(c))
        n_valid = int(mask.sum())
        per_micro.append({
            "tokens": n_valid,
            "candidates_1_5": int(((c > 1) & (c < 5)).sum()),
            "cov_std": std,
            **{f"quota@{r:g}": max(1, int(r * n_valid)) for r in ratios},
        })  # fmt: skip

    cov, sign, z = torch.cat(cov_all), torch.cat(sign_all), torch.cat(z_all)
    positive = cov.clamp(min=0)
    ranked = positive.sort(descending=True).values
    total = float(positive.sum()) or 1.0
    report = {
        "responses": len(logps),
        "reward_mean": sum(rewards) / len(rewards),
        "tokens": int(cov.numel()),
        "cov_quantiles": {q: float(cov.quantile(float(q))) for q in ("0.5", "0.9", "0.99", "0.999")},
        "cov_max": float(cov.max()),
        "share_in_1_5": float(((cov > 1) & (cov < 5)).float().mean()),
        "micro_batches": len(per_micro),
        "micro_batches_with_a_candidate_in_1_5": sum(m["candidates_1_5"] > 0 for m in per_micro),
        "tokens_per_micro_batch": sum(m["tokens"] for m in per_micro) / len(per_micro),
        "positive_mass_share_adv_pos": float(positive[sign > 0].sum()) / total,
        "positive_mass_share_adv_neg": float(positive[sign < 0].sum()) / total,
        "positive_mass_share_in_1_5": float(cov[(cov > 1) & (cov < 5)].sum()) / total,
        **{
            f"positive_mass_share_top{p}pct": float(ranked[: max(1, int(p / 100 * cov.numel()))].sum()) / total
            for p in (1, 2, 5)
        },  # fmt: skip
        "z_quantiles": {q: float(z.quantile(float(q))) for q in ("0.5", "0.9", "0.99", "0.999")},
        **{f"share_z_above_{t}": float((z > t).float().mean()) for t in (1, 2, 3, 5)},
        **{f"quota_mean@{r:g}": sum(m[f"quota@{r:g}"] for m in per_micro) / len(per_micro) for r in ratios},
    }
    for key, value in report.items():
        print(f"{key:44s} {json.dumps(value) if isinstance(value, dict) else f'{value:.4g}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": report, "micro_batches": per_micro}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
