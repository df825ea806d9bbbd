"""How a step's samples are laid out over the policy's ranks and cut into micro-batches: by a fixed number of
sequences (`--actor.micro_batch_size`, the default), or by a token budget (`--train.max_tokens_per_micro_batch`).

A layout says, for every rank and every optimizer mini-batch, which of the step's samples form each micro-batch.
Mini-batch m is always the same samples (the m-th contiguous slice of the step's), whatever the number of ranks or
the split, so the loss, normalised over the whole mini-batch on all ranks, and its gradient do not depend on the
layout (docs/guides/long_responses.md). What does depend on it: a per-micro-batch selection (Clip-Cov
and KL-Cov at `--loss.scope micro_batch`) sees other neighbours.

With a token budget, each mini-batch is first dealt out over the ranks with the token counts balanced
(Karmarkar-Karp's largest differencing method), then each rank's share is cut into the fewest micro-batches of at most
`budget` tokens, again balanced; every rank runs the same number of micro-batches in each mini-batch (the
collectives of a ZeRO forward and backward pair up rank by rank), a rank short of work running empty stand-ins. A
prompt's responses stay together where shared-prefix packing can use them: as one unit while they fit the budget.

Pure logic, light on purpose: the driver imports it (PolicyGroup, ReferenceGroup) and the unit tests check it alone.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# [mini-batch][micro-batch] -> indices into the step's samples; an empty micro-batch is a stand-in
RankLayout = list[list[list[int]]]


@dataclass(frozen=True)
class StepLayout:
    """One step's samples over the ranks: `ranks[r][m][j]` are the samples of rank r's j-th micro-batch of
    mini-batch m (indices into the step's list)."""

    ranks: list[RankLayout]

    def order(self, rank: int) -> list[int]:
        """Rank `rank`'s samples in the order its micro-batches take them."""
        return [i for mini in self.ranks[rank] for micro in mini for i in micro]

    def sizes(self, rank: int) -> list[list[int]]:
        """Rank `rank`'s micro-batch sizes per mini-batch (0: a stand-in): with `order`, all the rank needs."""
        return [[len(micro) for micro in mini] for mini in self.ranks[rank]]


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Indices 0..n-1 in `k` sets whose weight sums are as even as the largest differencing method makes them.

    Every item starts as a partial solution of k sets, one holding it. The two partial solutions whose heaviest and
    lightest sets differ most are merged, the heaviest set of one with the lightest of the other, so that their
    differences cancel; when one solution is left it is the answer. Sets may be empty when n < k. Deterministic: ties
    break by the order the partial solutions were made. Each set's indices ascend; sets come heaviest first."""
    if k < 1:
        raise ValueError(f"k {k} must be >= 1")
    # a partial solution: k (sum, indices) sets, heaviest first; the heap pops the largest spread first
    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, w in enumerate(weights):
        sets = [(int(w), [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-int(w), next(counter), sets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a's heaviest with b's lightest, and so on down
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    return [sorted(indices) for _, indices in heap[0][2]]


def fixed_layout(n_samples: int, n_mini: int, n_ranks: int, micro_batch_size: int) -> StepLayout:
    """Today's split: rank r takes the r-th equal slice of every mini-batch and cuts it into micro-batches of
    `micro_batch_size` sequences (the last may be shorter)."""
    per_mini = n_samples // n_mini
    per_rank = per_mini // n_ranks
    ranks = []
    for r in range(n_ranks):
        minis = []
        for m in range(n_mini):
            start = m * per_mini + r * per_rank
            share = list(range(start, start + per_rank))
            minis.append([share[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
        ranks.append(minis)
    return StepLayout(ranks)


def token_layout(
    lengths: Sequence[int],
    prompt_keys: Sequence[object],
    n_mini: int,
    n_ranks: int,
    budget: int,
    keep_groups: bool,
) -> StepLayout:
    """The token-budget split. `lengths[i]`: sample i's tokens (prompt + response); `prompt_keys[i]`: what tells its
    prompt apart (consecutive samples with equal keys are one prompt's responses); `keep_groups`: keep those
    together where they fit (shared-prefix packing on)."""
    if budget < 1:
        raise ValueError(f"token budget {budget} must be >= 1")
    per_mini = len(lengths) // n_mini
    ranks: list[RankLayout] = [[] for _ in range(n_ranks)]
    for m in range(n_mini):
        samples = list(range(m * per_mini, (m + 1) * per_mini))
        groups = _prompt_groups(samples, prompt_keys) if keep_groups else [[i] for i in samples]
        # whole groups over the ranks while there are enough of them for every rank to get one
        units = groups if len(groups) >= n_ranks else [[i] for i in samples]
        unit_tokens = [sum(lengths[i] for i in u) for u in units]
        shares = [[i for j in part for i in units[j]] for part in karmarkar_karp(unit_tokens, n_ranks)]
        # each rank's fewest micro-batches within the budget; all ranks then run the most any of them needs
        share_units = [_budget_units(share, prompt_keys, lengths, budget, keep_groups) for share in shares]
        fewest = [_fewest_parts(u, lengths, budget) for u in share_units]
        count = max(len(p) for p in fewest)
        for r, (units_r, own) in enumerate(zip(share_units, fewest)):
            parts = _partition(units_r, lengths, count)
            if any(_tokens(p, lengths) > budget and len(p) > 1 for p in parts):
                parts = own + [[] for _ in range(count - len(own))]  # the rank's own cut, padded with stand-ins
            # heaviest first on every rank: the ranks' j-th micro-batches, which run in lockstep, are alike
            parts.sort(key=lambda p: -_tokens(p, lengths))
            ranks[r].append(parts)
    return StepLayout(ranks)


def layout_for(
    lengths: Sequence[int],
    prompt_keys: Sequence[object],
    n_mini: int,
    n_ranks: int,
    micro_batch_size: int,
    max_tokens: int,
    keep_groups: bool,
) -> StepLayout:
    """The layout the flags ask for: by token budget when `max_tokens` > 0, else by `micro_batch_size`."""
    if max_tokens > 0:
        return token_layout(lengths, prompt_keys, n_mini, n_ranks, max_tokens, keep_groups)
    return fixed_layout(len(lengths), n_mini, n_ranks, micro_batch_size)


def fixed_sizes(n: int, micro_batch_size: int, forwards: int | None = None) -> list[int]:
    """`n` sequences in micro-batches of `micro_batch_size` (the last may be shorter), padded with stand-ins (0) up
    to `forwards` micro-batches when given."""
    sizes = [min(micro_batch_size, n - i) for i in range(0, n, micro_batch_size)]
    if forwards is not None and len(sizes) > forwards:
        raise ValueError(f"{n} sequences make {len(sizes)} micro-batches of {micro_batch_size}, over {forwards}")
    return sizes + [0] * ((forwards or len(sizes)) - len(sizes))


def forward_batches(lengths: Sequence[int], n_ranks: int, max_tokens: int) -> list[list[list[int]]]:
    """A forward-only pass (the reference's): `lengths` in micro-batches of at most `max_tokens` tokens (a longer
    sequence alone), dealt over `n_ranks` ranks with the tokens balanced, every rank with the same number of
    micro-batches (stand-ins where short). `[rank][micro]` -> indices."""
    layout = token_layout(lengths, list(range(len(lengths))), 1, n_ranks, max_tokens, keep_groups=False)
    return [rank[0] for rank in layout.ranks]


def _prompt_groups(samples: list[int], prompt_keys: Sequence[object]) -> list[list[int]]:
    """Runs of consecutive samples with one prompt."""
    groups: list[list[int]] = []
    for i in samples:
        if groups and prompt_keys[groups[-1][-1]] == prompt_keys[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _budget_units(
    share: list[int], prompt_keys: Sequence[object], lengths: Sequence[int], budget: int, keep_groups: bool
) -> list[list[int]]:
    """What a micro-batch is made of: a prompt's responses together while they fit the budget, else one each."""
    groups = _prompt_groups(share, prompt_keys) if keep_groups else [[i] for i in share]
    return [u for g in groups for u in ([g] if _tokens(g, lengths) <= budget else [[i] for i in g])]


def _partition(units: list[list[int]], lengths: Sequence[int], k: int) -> list[list[int]]:
    parts = karmarkar_karp([_tokens(u, lengths) for u in units], k)
    return [[i for j in part for i in units[j]] for part in parts]


def _fewest_parts(units: list[list[int]], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The fewest balanced micro-batches of at most `budget` tokens each (a unit over the budget alone); at least one
    (an empty share gets one stand-in)."""
    if not units:
        return [[]]
    # a unit over the budget takes a micro-batch of its own; the rest need at least their tokens / budget
    tokens = [_tokens(u, lengths) for u in units]
    over = sum(t > budget for t in tokens)
    k = min(len(units), max(1, over + math.ceil(sum(t for t in tokens if t <= budget) / budget)))
    while True:
        parts = _partition(units, lengths, k)
        if k >= len(units) or all(_tokens(p, lengths) <= budget or _is_one_unit(p, units) for p in parts):
            return parts
        k += 1


def _is_one_unit(part: list[int], units: list[list[int]]) -> bool:
    return any(sorted(part) == sorted(u) for u in units)


def _tokens(indices: list[int], lengths: Sequence[int]) -> int:
    return sum(lengths[i] for i in indices)
