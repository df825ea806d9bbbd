"""The reference's CPU twin of its GPU layout: DeepSpeed ZeRO-3 inference over two ranks (gloo) gives the
single-process reference's log-probs, with shared-prefix packing, a rank that runs a stand-in forward, the output
head in chunks, and its rendezvous on loopback only."""

import random

import pytest

from entropy_openrlhf.actors.micro_batches import forward_batches
from entropy_openrlhf.actors.reference import ReferenceGroup
from entropy_openrlhf.cluster import exposed_listeners, ray_processes
from entropy_openrlhf.config import from_args

pytestmark = pytest.mark.integration

BUDGET = 40  # tokens per reference forward in the token-budget case: a few sequences each


def rollouts(groups: int = 5, per_prompt: int = 2, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Responses in prompt groups, as the rollout gives them (packing shares each group's prompt)."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [1, *(rng.randrange(3, 380) for _ in range(rng.randint(6, 14)))]
        for _ in range(per_prompt):
            prompts.append(prompt)
            responses.append([rng.randrange(3, 380) for _ in range(rng.randint(1, 9))])
    return prompts, responses


def test_two_zero3_ranks_give_the_single_reference_s_log_probs(ray_cluster, tiny_model):
    # 10 responses in micro-batches of 4: three micro-batches, so rank 1 runs one and a stand-in
    flags = ["--preset", "smoke", "--actor.micro_batch_size", "2", "--ref.micro_batch_size", "4",
             "--train.shared_prefix", "on", "--ref.timeout_s", "60"]  # fmt: skip
    prompts, responses = rollouts()

    single = ReferenceGroup(from_args(flags), tiny_model)
    try:
        expected = single.log_probs(prompts, responses)
        held_by_one = single.load_info[0]["full_param_elements"]
    finally:
        single.shutdown()

    group = ReferenceGroup(from_args([*flags, "--ref.num_workers", "2"]), tiny_model)
    try:
        # the ranks' rendezvous store and gloo listen on 127.0.0.1 only
        assert exposed_listeners(ray_processes()) == []
        got = group.log_probs(prompts, responses)
        again = group.log_probs(prompts[:3], responses[:3])  # one micro-batch: rank 1 runs a stand-in only
        # by a token budget (the driver reads it; a rank only cuts the sizes it is sent): micro-batches formed by
        # tokens, dealt over the ranks out of order, and the log-probs back in order
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        layout = forward_batches(lengths, 2, BUDGET)
        assert [i for rank in layout for micro in rank for i in micro] != list(range(len(prompts)))  # reordered
        group.cfg.ref.max_tokens_per_micro_batch = BUDGET
        by_tokens = group.log_probs(prompts, responses)
    finally:
        group.shutdown()

    assert all(info["zero3"] == 1.0 for info in group.load_info)
    # ZeRO-3 split the parameters as they loaded (the norms, under its persistence threshold, are gathered and
    # kept whole at the first forward)
    assert all(info["full_param_elements"] < held_by_one / 10 for info in group.load_info)
    assert [len(x) for x in got] == [len(r) for r in responses]
    worst = max(abs(a - b) for x, y in zip(got, expected) for a, b in zip(x, y))
    assert worst < 1e-5, f"ZeRO-3 log-probs differ from the single reference's by {worst}"
    assert max(abs(a - b) for x, y in zip(again, expected) for a, b in zip(x, y)) < 1e-5
    assert [len(x) for x in by_tokens] == [len(r) for r in responses]
    assert max(abs(a - b) for x, y in zip(by_tokens, expected) for a, b in zip(x, y)) < 1e-5

    # the output head in chunks of 3 response tokens (--train.head_chunk_tokens): the two ranks' micro-batches hold
    # different numbers of tokens (and rank 1 a stand-in), yet each calls the head as often (ZeRO-3's gathers pair up)
    chunked_group = ReferenceGroup(from_args([*flags, "--ref.num_workers", "2", "--train.head_chunk_tokens", "3"]),
                                   tiny_model)  # fmt: skip
    try:
        chunked = chunked_group.log_probs(prompts, responses)
        chunked_again = chunked_group.log_probs(prompts[:3], responses[:3])
    finally:
        chunked_group.shutdown()
    assert max(abs(a - b) for x, y in zip(chunked, expected) for a, b in zip(x, y)) < 1e-5
    assert max(abs(a - b) for x, y in zip(chunked_again, expected) for a, b in zip(x, y)) < 1e-5
