"""Evaluation with the paper's protocol: avg@k sampled at T=0.6 for data sources named aime / aime25 / amc, greedy
pass@1 for every other source. Used in training (every `eval.every` steps) and by scripts/evaluate.py."""

from __future__ import annotations

from collections import defaultdict

from entropy_openrlhf.config import Config
from entropy_openrlhf.samples import PromptItem

SAMPLED_SOURCES = ("aime", "aime25", "amc")


def evaluate(rollout, reward, items: list[PromptItem], cfg: Config) -> dict[str, float]:
    """Metrics `eval/<source>/acc`, `eval/acc` (mean over sources) and `eval/response_len`."""
    sampled = [p for p in items if p.data_source.lower() in SAMPLED_SOURCES]
    greedy = [p for p in items if p.data_source.lower() not in SAMPLED_SOURCES]
    samples = []
    if greedy:
        samples += rollout.generate(
            greedy, n=1, temperature=0.0, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.train.seed, policy_version=-1,
        )  # fmt: skip
    if sampled:
        samples += rollout.generate(
            sampled, n=max(1, cfg.eval.n_samples), temperature=0.6, top_p=1.0,
            max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.train.seed, policy_version=-1,
        )  # fmt: skip
    if not samples:
        return {}
    samples, _ = reward.score(samples)
    by_source: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source or "default"].append(1.0 if s.acc else 0.0)
    out = {f"eval/{src}/acc": sum(v) / len(v) for src, v in sorted(by_source.items())}
    out["eval/acc"] = sum(out.values()) / len(out)
    out["eval/response_len"] = sum(len(s.response_token_ids) for s in samples) / len(samples)
    return out
