"""Evaluation on held-out prompts, used in training (every `eval.every` steps) and by scripts/evaluate.py.

Two protocols, both reported when `eval.n_samples` > 1:
- Accuracy, the paper's: greedy pass@1 for every source except those named aime / aime25 / amc, whose accuracy is
  avg@n over `eval.n_samples` responses sampled at `eval.temperature` (0.6). Metrics `eval/<source>/acc` and
  `eval/acc` (the mean over sources).
- Exploration, pass@k: `eval.n_samples` responses per prompt sampled at `eval.temperature`, for every source.
  A policy that still explores finds answers a collapsed one no longer samples; pass@k for large k shows it where
  greedy accuracy cannot. Per source and averaged over sources: `pass@k` for k = 1, 2, 4, ... n (the unbiased
  estimator), `maj@n` (majority vote over the verifier's extracted answers, `reward_info["pred"]`), and 95%
  bootstrap intervals over prompts for pass@1 and pass@n (`pass@1_ci95_low` / `_high`), and per source the
  count of correct responses of each prompt (`eval/<source>/correct_counts`, a list in prompt-index order: what a
  later analysis needs to resample prompts and samples, or to set pass@k beside a chance baseline).
The aime/amc sources' sampled responses serve both protocols: they are generated once.
"""

from __future__ import annotations

from collections import defaultdict

from entropy_openrlhf.algorithms.metrics import bootstrap_interval, majority_correct, pass_at_k, pass_at_k_ladder
from entropy_openrlhf.config import Config
from entropy_openrlhf.samples import PromptItem, Sample

SAMPLED_SOURCES = ("aime", "aime25", "amc")


def _source(s: Sample | PromptItem) -> str:
    return s.data_source or "default"


def evaluate(rollout, reward, items: list[PromptItem], cfg: Config) -> dict[str, float | list[int]]:
    """Every eval metric of `items` (module docstring); {} when there are none."""
    n = max(1, cfg.eval.n_samples)
    competition = [p for p in items if p.data_source.lower() in SAMPLED_SOURCES]
    greedy_items = [p for p in items if p.data_source.lower() not in SAMPLED_SOURCES]
    sampled_items = items if n > 1 else competition
    greedy, sampled = [], []
    if greedy_items:
        greedy = rollout.generate(
            greedy_items, n=1, temperature=0.0, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.train.seed, policy_version=-1,
        )  # fmt: skip
    if sampled_items:
        sampled = rollout.generate(
            sampled_items, n=n, temperature=cfg.eval.temperature, top_p=1.0,
            max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.train.seed, policy_version=-1,
        )  # fmt: skip
    if not greedy and not sampled:
        return {}
    scored, _ = reward.score(greedy + sampled)
    greedy, sampled = scored[: len(greedy)], scored[len(greedy) :]

    # accuracy: greedy where a source was generated greedily, else avg@n of its samples
    acc: dict[str, list[float]] = defaultdict(list)
    for s in greedy:
        acc[_source(s)].append(float(s.acc))
    for s in sampled:
        if s.data_source.lower() in SAMPLED_SOURCES:
            acc[_source(s)].append(float(s.acc))
    out = {f"eval/{src}/acc": sum(v) / len(v) for src, v in sorted(acc.items())}
    out["eval/acc"] = sum(out.values()) / len(out)
    lengths = [len(s.response_token_ids) for s in greedy + sampled]
    out["eval/response_len"] = sum(lengths) / len(lengths)
    if n > 1:
        out.update(pass_at_k_metrics(sampled, n, cfg.eval.bootstrap, cfg.train.seed))
    return out


def pass_at_k_metrics(
    samples: list[Sample], n: int, resamples: int = 1000, seed: int = 0
) -> dict[str, float | list[int]]:
    """pass@k, maj@n and the bootstrap intervals of pass@1 and pass@n, per source and averaged over sources, from
    `n` scored responses per prompt; per source also each prompt's count of correct responses (0..n), in the order
    of the prompts' index, `eval/<source>/correct_counts`."""
    by_prompt: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for s in samples:
        by_prompt[(_source(s), s.prompt_index)].append(s)
    sources = sorted({src for src, _ in by_prompt})
    ks = pass_at_k_ladder(n)
    # per source, per k: the per-prompt values whose mean is the metric
    values: dict[str, dict[str, list[float]]] = {src: defaultdict(list) for src in sources}
    counts: dict[str, list[tuple[int, int]]] = defaultdict(list)  # per source: (prompt index, correct responses)
    for (src, index), group in by_prompt.items():
        if len(group) != n:
            raise ValueError(f"pass@k: prompt {group[0].prompt_index} of {src!r} has {len(group)} responses, not {n}")
        correct = sum(bool(s.acc) for s in group)
        counts[src].append((index, correct))
        for k in ks:
            values[src][f"pass@{k}"].append(pass_at_k(n, correct, k))
        answers = [s.reward_info.get("pred") if isinstance(s.reward_info, dict) else None for s in group]
        values[src][f"maj@{n}"].append(float(majority_correct(answers, [bool(s.acc) for s in group])))

    out: dict[str, float | list[int]] = {}
    for name in [f"pass@{k}" for k in ks] + [f"maj@{n}"]:
        means = [sum(values[src][name]) / len(values[src][name]) for src in sources]
        for src, mean in zip(sources, means):
            out[f"eval/{src}/{name}"] = mean
        out[f"eval/{name}"] = sum(means) / len(means)
    for name in dict.fromkeys(["pass@1", f"pass@{n}"]):  # pass@1 == pass@n when n == 1: one interval
        for src in sources:
            low, high = bootstrap_interval([values[src][name]], resamples=resamples, seed=seed)
            out[f"eval/{src}/{name}_ci95_low"], out[f"eval/{src}/{name}_ci95_high"] = low, high
        low, high = bootstrap_interval([values[src][name] for src in sources], resamples=resamples, seed=seed)
        out[f"eval/{name}_ci95_low"], out[f"eval/{name}_ci95_high"] = low, high
    for src in sources:
        out[f"eval/{src}/correct_counts"] = [c for _, c in sorted(counts[src])]
    return out
