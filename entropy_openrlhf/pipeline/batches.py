"""What the producer hands the trainer: a rollout batch, the seeded stream of prompts it is drawn from, and the
rewards grouped the way the advantage estimators read them."""

from __future__ import annotations

import random
from dataclasses import dataclass

from entropy_openrlhf.rollouts.python_tool import tool_metrics
from entropy_openrlhf.samples import PromptItem, Sample


@dataclass
class Batch:
    step: int
    groups: list[list[Sample]]  # one list of n responses per prompt
    metrics: dict[str, float]
    stream_after: tuple[int, int] = (0, 0)  # prompt-stream position after this batch: where a resume continues


class PromptStream:
    """Endless seeded pass over the training prompts, one epoch after another; `position` resumes it."""

    def __init__(self, items: list[PromptItem], batch_size: int, seed: int, shuffle: bool):
        self.items, self.batch_size, self.seed, self.shuffle = items, batch_size, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptItem]:
        return [self.next_prompt() for _ in range(self.batch_size)]

    def next_prompt(self) -> PromptItem:
        return self.items[self.draw()[1]]

    def draw(self) -> tuple[int, int]:
        """The next prompt as (epoch, its position in `items`): what a streaming checkpoint records of a prompt
        drawn but not yet trained, to roll it out again after a resume (the epoch gives its seed)."""
        if self.offset >= len(self._order):
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._make_order()
        position = self._order[self.offset]
        self.offset += 1
        return self.epoch, position


def group_rewards(groups: list[list[Sample]]) -> tuple[list[float], list[int]]:
    rewards, ids = [], []
    for g, group in enumerate(groups):
        for s in group:
            rewards.append(float(s.reward))
            ids.append(g)
    return rewards, ids


def mixed_sources(samples: list[Sample]) -> bool:
    """Whether the step's samples come from two or more `data_source`s: only then are metrics split by source."""
    return len({s.data_source for s in samples}) > 1


def sample_metrics(samples: list[Sample], step: int) -> dict[str, float]:
    """What the step's training samples were: how far behind the trainer's weights (the trainer is at `step`)
    their policy was, their length and truncation, their count, the version the step publishes, and, for tool
    episodes, their tool calls and turns (python_tool.tool_metrics)."""
    staleness = [step - s.policy_version for s in samples]
    lengths = [len(s.response_token_ids) for s in samples]
    return {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        "rollout/response_len": sum(lengths) / len(lengths),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/samples": float(len(samples)),
        "policy/version": float(step + 1),
        **tool_metrics(samples),
    }


def source_metrics(samples: list[Sample]) -> dict[str, float]:
    """`reward/<source>/acc`, `reward/<source>/mean` and `rollout/<source>/response_len` over the step's training
    samples of each data source ("default" for none); {} when they share one source (docs/guides/metrics.md)."""
    if not mixed_sources(samples):
        return {}
    by_source: dict[str, list[Sample]] = {}
    for s in samples:
        by_source.setdefault(s.data_source or "default", []).append(s)
    metrics = {}
    for source, group in sorted(by_source.items()):
        n = len(group)
        metrics[f"reward/{source}/acc"] = sum(float(s.acc) for s in group) / n
        metrics[f"reward/{source}/mean"] = sum(s.reward for s in group) / n
        metrics[f"rollout/{source}/response_len"] = sum(len(s.response_token_ids) for s in group) / n
    return metrics


COUNTED = ("reward/timeouts", "reward/errors")  # reward metrics that count responses: summed over rounds


def merge_reward_metrics(rounds: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The step's `reward/*` metrics over every response generated in it, from each generation round's (its number
    of responses, its metrics): with dynamic sampling a step generates several rounds. Counts add up, `reward/std`
    pools the rounds' variances about the step's mean, and every other metric (a mean over a round's responses) is
    the mean weighted by responses, over the rounds that logged it (exact for a metric every response of a round
    gives, as the reward group's own do; a verifier's log that only some responses give is weighted by all)."""
    if len(rounds) == 1:
        return dict(rounds[0][1])
    merged: dict[str, float] = {}
    for key in sorted({k for _, m in rounds for k in m}):
        have = [(n, m[key]) for n, m in rounds if key in m]
        if key in COUNTED:
            merged[key] = sum(v for _, v in have)
        elif key != "reward/std":
            merged[key] = sum(n * v for n, v in have) / sum(n for n, _ in have)
    if all("reward/std" in m and "reward/mean" in m for _, m in rounds):
        total = sum(n for n, _ in rounds)
        second_moment = sum(n * (m["reward/std"] ** 2 + m["reward/mean"] ** 2) for n, m in rounds) / total
        merged["reward/std"] = max(second_moment - merged["reward/mean"] ** 2, 0.0) ** 0.5
    return merged
