"""What the producer hands the trainer: a rollout batch, the seeded stream of prompts it is drawn from, and the
rewards grouped the way the advantage estimators read them."""

from __future__ import annotations

import random
from dataclasses import dataclass

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
        out = []
        while len(out) < self.batch_size:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.items[self._order[self.offset]])
            self.offset += 1
        return out


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
