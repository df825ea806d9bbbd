"""The reference group's config and its pure logic: when it runs under DeepSpeed ZeRO-3, what it refuses, what it
reserves, how a batch is dealt to its ranks and the DeepSpeed config it builds (the two-rank run itself is in
tests/integration/test_reference.py)."""

import math

import pytest

from entropy_openrlhf.actors.reference import deal_micro_batches, dealt_log_probs
from entropy_openrlhf.actors.reference_model import reference_ds_config
from entropy_openrlhf.cluster_fit import group_needs
from entropy_openrlhf.config import (
    ConfigError,
    from_args,
    reference_micro_batch_size,
    reference_uses_deepspeed,
    validate,
)
from entropy_openrlhf.resources import group_resources

GPU_POLICY = ["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "1"]
ON = ["--ref.enabled", "true"]  # these tests are about a reference that runs (by default only a KL term starts it)


def refused(*flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(from_args([*ON, *flags]))
    return str(e.value)


# ---------------------------------------------------------------------------------------------- config


def test_by_default_one_plain_rank_as_before():
    cfg = from_args([])
    assert cfg.ref.num_workers == 1 and cfg.ref.offload is False
    assert not reference_uses_deepspeed(cfg.ref)
    validate(cfg)


@pytest.mark.parametrize("flags", [["--ref.num_workers", "2"], [*GPU_POLICY, "--ref.offload", "true"]])
def test_several_ranks_or_offload_run_under_zero3(flags):
    cfg = from_args([*ON, *flags])
    validate(cfg)
    assert reference_uses_deepspeed(cfg.ref)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--ref.num_workers", "0"], "--ref.num_workers: 0 must be >= 1"),
        (["--ref.timeout_s", "0"], "--ref.timeout_s: 0 must be > 0"),
        (["--ref.micro_batch_size", "-1"], "--ref.micro_batch_size: -1 must be >= 0"),
        # the reference follows the CPU policy onto the CPU, where there is nothing to offload to
        (["--ref.offload", "true"], "--ref.offload: true needs a reference on GPUs"),
        (["--ref.num_gpus", "0", "--ref.offload", "true"], "on the CPU here (--ref.num_gpus 0)"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(flags, needle):
    msg = refused(*flags)
    assert needle in msg and "\n" not in msg


def test_fractional_gpus_for_several_reference_ranks_are_refused():
    # auto: the single fractional policy rank's share, 0.5, for each of two reference ranks
    msg = refused("--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "0.5", "--ref.num_workers", "2")
    assert msg.startswith("invalid config: --ref.num_gpus: 0.5 GPU per reference rank (auto")
    assert "Duplicate GPU" in msg and "--ref.num_gpus 1" in msg
    msg = refused(*GPU_POLICY, "--ref.num_gpus", "0.25", "--ref.num_workers", "4")
    assert "--ref.num_gpus: 0.25 GPU per reference rank with 4 ranks" in msg


def test_whole_gpus_per_rank_and_a_disabled_reference_pass():
    validate(from_args([*ON, *GPU_POLICY, "--ref.num_workers", "4", "--ref.offload", "true"]))
    validate(from_args(["--ref.enabled", "false", "--ref.offload", "true"]))  # off: nothing to run anywhere


def test_the_reference_micro_batch_defaults_to_the_policy_s():
    assert reference_micro_batch_size(from_args(["--actor.micro_batch_size", "3"])) == 3
    cfg = from_args(["--actor.micro_batch_size", "3", "--ref.micro_batch_size", "16"])
    assert reference_micro_batch_size(cfg) == 16


def test_every_rank_reserves_its_share():
    cfg = from_args([*ON, *GPU_POLICY, "--ref.num_workers", "3", "--ref.num_cpus", "2"])
    assert group_resources(cfg)["reference"] == {"actors": 3, "GPU": 3.0, "CPU": 6.0}
    (ref,) = [g for g in group_needs(cfg) if g.name == "reference"]
    assert ref.actors == 3 and ref.bundle["GPU"] == 1.0 and ref.bundle["CPU"] == 2.0


# ---------------------------------------------------------------------------------------------- dealing a batch


@pytest.mark.parametrize(
    "n,mbs,world,shards,forwards",
    [
        (16, 4, 1, [(0, 16)], 4),
        (16, 4, 2, [(0, 8), (8, 16)], 2),
        (10, 4, 2, [(0, 8), (8, 10)], 2),  # rank 1: one micro-batch and one stand-in
        (5, 4, 4, [(0, 4), (4, 5), (5, 5), (5, 5)], 1),  # fewer micro-batches than ranks
        (0, 4, 2, [(0, 0), (0, 0)], 0),
    ],
)
def test_deal_micro_batches_examples(n, mbs, world, shards, forwards):
    assert deal_micro_batches(n, mbs, world) == (shards, forwards)


@pytest.mark.parametrize("n", range(0, 23))
@pytest.mark.parametrize("mbs", [1, 3, 4])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_ranks_run_one_rank_s_micro_batches_in_order_with_equal_forwards(n, mbs, world):
    shards, forwards = deal_micro_batches(n, mbs, world)
    # the shards tile the batch in order
    assert shards[0][0] == 0 and shards[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    # each rank's own cut gives exactly one rank's micro-batches, none more than the common forward count
    single = [(i, min(i + mbs, n)) for i in range(0, n, mbs)]
    mine = [(s + i, min(s + i + mbs, e)) for s, e in shards for i in range(0, e - s, mbs)]
    assert mine == single
    assert all(math.ceil((e - s) / mbs) <= forwards for s, e in shards)
    assert forwards == math.ceil(len(single) / world)  # no rank waits on more forwards than it must


def test_deal_micro_batches_refuses_empty_sizes():
    with pytest.raises(ValueError):
        deal_micro_batches(4, 0, 2)
    with pytest.raises(ValueError):
        deal_micro_batches(4, 2, 0)


# ---------------------------------------------------------------------------------------------- DeepSpeed config


@pytest.mark.parametrize("offload", [False, True])
def test_ds_config_is_openrlhf_s_eval_config_at_stage_3(offload):
    ds = reference_ds_config(hidden_size=64, bf16=True, micro_batch_size=2, offload=offload)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"] == {"device": "cpu" if offload else "none", "pin_memory": True}
    # transformers' rules for OpenRLHF's "auto": small tensors stay whole on every rank, the rest is split
    assert zero["stage3_param_persistence_threshold"] == 640
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert ds["bf16"] == {"enabled": True} and ds["train_micro_batch_size_per_gpu"] == 2
    assert reference_ds_config(64, False, 2, offload)["bf16"] == {"enabled": False}


class EchoGroup:
    """A reference group's driver-facing side without Ray: each rank answers with the prompt it got in each of its
    micro-batches' places, and keeps what it was sent."""

    def __init__(self, n_ranks: int):
        self.actors = [object()] * n_ranks
        self.sent: list[tuple] = []

    def call_each(self, method: str, per_rank, *, timeout_s=None, what=""):
        self.sent = list(per_rank)
        return [[[float(p[0])] for p in prompts] for prompts, _, _ in per_rank]


@pytest.mark.parametrize("budget", [0, 9])
@pytest.mark.parametrize("n_ranks", [1, 2, 3])
def test_dealt_log_probs_sends_every_rank_its_micro_batch_sizes_and_puts_the_answers_in_order(budget, n_ranks):
    # 7 sequences of 3 to 6 tokens: by sequences (2 each) or by a budget of 9 tokens
    cfg = from_args([*ON, "--ref.micro_batch_size", "2", "--ref.max_tokens_per_micro_batch", str(budget)])
    prompts = [[i] for i in range(7)]
    responses = [[0] * (2 + i % 4) for i in range(7)]
    group = EchoGroup(n_ranks)
    out = dealt_log_probs(group, cfg, prompts, responses, "log_probs")
    assert out == [[float(i)] for i in range(7)]  # every answer back in the batch's place
    forwards = {len(sizes) for _, _, sizes in group.sent}
    assert len(forwards) == 1  # every rank runs the same number of forwards
    for rank_prompts, rank_responses, sizes in group.sent:
        assert sum(sizes) == len(rank_prompts) == len(rank_responses)
        if budget:  # no micro-batch over the budget (one sequence alone may be)
            start = 0
            for size in sizes:
                lengths = [1 + len(r) for r in rank_responses[start : start + size]]
                assert size <= 1 or sum(lengths) <= budget
                start += size
        else:
            assert all(0 <= size <= 2 for size in sizes)
    assert sorted(p[0] for rank_prompts, _, _ in group.sent for p in rank_prompts) == list(range(7))
