"""The layout of a step's samples over ranks and micro-batches (actors/micro_batches.py): Karmarkar-Karp against
known answers and brute force, today's fixed split unchanged, and the token budget's promises (every sample once,
mini-batches unchanged, the budget kept, equal micro-batch counts on every rank, prompt groups kept together)."""

import itertools
import random

import pytest

from entropy_openrlhf.actors.micro_batches import (
    fixed_layout,
    forward_batches,
    karmarkar_karp,
    layout_for,
    token_layout,
)


def sums(parts, weights):
    return [sum(weights[i] for i in p) for p in parts]


def test_karmarkar_karp_gives_the_differencing_methods_known_answer():
    # the textbook example: differencing 8,7,6,5,4 leaves a difference of 2 (16 against 14), where 15/15 exists
    weights = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(weights, 2)
    assert sorted(sums(parts, weights)) == [14, 16]
    assert sorted(i for p in parts for i in p) == list(range(5))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_karmarkar_karp_stays_within_four_thirds_of_the_best_split(k):
    rng = random.Random(k)
    for _ in range(30):
        weights = [rng.randint(1, 100) for _ in range(rng.randint(k, 8))]
        parts = karmarkar_karp(weights, k)
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
        best = min(
            max(sum(w for w, a in zip(weights, assign) if a == j) for j in range(k))
            for assign in itertools.product(range(k), repeat=len(weights))
        )
        assert max(sums(parts, weights)) <= best * 4 / 3 + 1e-9


def test_karmarkar_karp_leaves_sets_empty_when_there_are_fewer_items():
    parts = karmarkar_karp([5, 3], 4)
    assert sorted(map(tuple, parts)) == [(), (), (0,), (1,)]
    assert karmarkar_karp([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="k 0"):
        karmarkar_karp([1], 0)


def old_shards(n, n_mini, n_ranks):
    """PolicyGroup's slicing before layouts existed."""
    per_mini = n // n_mini
    per_rank = per_mini // n_ranks
    return [[m * per_mini + r * per_rank + i for m in range(n_mini) for i in range(per_rank)] for r in range(n_ranks)]


@pytest.mark.parametrize("n,n_mini,n_ranks,mbs", [(16, 4, 1, 4), (16, 2, 2, 3), (32, 4, 2, 2), (12, 1, 3, 5)])
def test_fixed_layout_is_the_old_split(n, n_mini, n_ranks, mbs):
    layout = fixed_layout(n, n_mini, n_ranks, mbs)
    for r, shard in enumerate(old_shards(n, n_mini, n_ranks)):
        assert layout.order(r) == shard
        per_rank = n // n_mini // n_ranks
        want = [min(mbs, per_rank - i) for i in range(0, per_rank, mbs)]
        assert layout.sizes(r) == [want] * n_mini


def random_step(rng, n_prompts, n_per_prompt, long_every=5):
    lengths, keys = [], []
    for p in range(n_prompts):
        prompt = rng.randint(10, 40)
        for _ in range(n_per_prompt):
            response = rng.randint(1, 60) * (20 if rng.randrange(long_every) == 0 else 1)
            lengths.append(prompt + response)
            keys.append(p)
    return lengths, keys


@pytest.mark.parametrize("n_ranks", [1, 2, 3])
@pytest.mark.parametrize("keep_groups", [False, True])
def test_token_layout_keeps_every_promise(n_ranks, keep_groups):
    rng = random.Random(n_ranks * 10 + keep_groups)
    for trial in range(20):
        n_mini = rng.choice([1, 2, 4])
        lengths, keys = random_step(rng, n_prompts=4 * n_mini, n_per_prompt=rng.choice([2, 4]))
        budget = rng.choice([100, 300, 1000, 5000])
        layout = token_layout(lengths, keys, n_mini, n_ranks, budget, keep_groups)
        per_mini = len(lengths) // n_mini
        for m in range(n_mini):
            minis = [layout.ranks[r][m] for r in range(n_ranks)]
            # mini-batch m is the m-th slice, each sample once
            got = sorted(i for mini in minis for micro in mini for i in micro)
            assert got == list(range(m * per_mini, (m + 1) * per_mini))
            # every rank the same number of micro-batches
            assert len({len(mini) for mini in minis}) == 1
            for micro in (micro for mini in minis for micro in mini):
                tokens = sum(lengths[i] for i in micro)
                # within the budget, unless it is one sequence that alone exceeds it (a prompt's responses stay
                # together only while they fit)
                assert tokens <= budget or len(micro) == 1, (trial, micro, tokens)
        assert sorted(i for r in range(n_ranks) for i in layout.order(r)) == list(range(len(lengths)))


def test_token_layout_uses_the_fewest_micro_batches_the_budget_allows():
    # one rank, 8 sequences of 100 tokens, a budget of 250: 800 tokens need 4 micro-batches of two
    layout = token_layout([100] * 8, list(range(8)), 1, 1, 250, keep_groups=False)
    assert layout.sizes(0) == [[2, 2, 2, 2]]
    # a sequence longer than the budget runs alone
    layout = token_layout([900, 100, 100], [0, 1, 2], 1, 1, 250, keep_groups=False)
    assert sorted(map(sorted, layout.ranks[0][0])) == [[0], [1, 2]]


def test_token_layout_balances_the_ranks_and_pads_the_short_one_with_stand_ins():
    # one 1000-token response and six of 100: the long one's rank gets it alone, the other rank's share needs
    # more micro-batches, so the first pads with empty stand-ins to run as many
    lengths = [1000, 100, 100, 100, 100, 100, 100]
    layout = token_layout(lengths, list(range(7)), 1, 2, 250, keep_groups=False)
    loads = sorted(sum(lengths[i] for i in layout.order(r)) for r in range(2))
    assert loads == [600, 1000]
    sizes = sorted((layout.sizes(r)[0] for r in range(2)), key=lambda s: s[0])
    assert sizes == [[1, 0, 0], [2, 2, 2]]


def test_token_layout_keeps_a_prompts_responses_together_while_they_fit():
    # two prompts of four 50-token responses: 200 tokens each fit a budget of 250, so each is one micro-batch
    keys = [0, 0, 0, 0, 1, 1, 1, 1]
    layout = token_layout([50] * 8, keys, 1, 1, 250, keep_groups=True)
    assert sorted(map(sorted, layout.ranks[0][0])) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # without keep_groups the balanced split is free to mix them; with a budget under a group's size a group splits
    layout = token_layout([50] * 8, keys, 1, 1, 120, keep_groups=True)
    assert all(sum(50 for _ in micro) <= 120 for micro in layout.ranks[0][0])
    # over two ranks the groups go whole, one to each
    layout = token_layout([50] * 8, keys, 1, 2, 1000, keep_groups=True)
    assert sorted(layout.order(r) for r in range(2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_layout_for_picks_the_split_the_flags_ask_for():
    lengths, keys = [10] * 8, [0] * 8
    assert layout_for(lengths, keys, 2, 1, 2, 0, False) == fixed_layout(8, 2, 1, 2)
    assert layout_for(lengths, keys, 2, 1, 2, 25, False) == token_layout(lengths, keys, 2, 1, 25, False)


def test_forward_batches_deals_every_sequence_once_with_equal_counts():
    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(37)]
    per_rank = forward_batches(lengths, 3, 400)
    assert len({len(r) for r in per_rank}) == 1
    assert sorted(i for r in per_rank for micro in r for i in micro) == list(range(37))
    assert all(sum(lengths[i] for i in micro) <= 400 or len(micro) == 1 for r in per_rank for micro in r)
