"""GPU placement decisions that only a GPU cluster would exercise, checked as pure functions and config checks
(no GPU needed): fractional policy ranks, the reference's hardware, the engines' visible devices, where an actor
is reported to run."""

import pytest

from entropy_openrlhf.config import ConfigError, from_args, validate

# ---------------------------------------------------------------------------------------------- fractional ranks


@pytest.mark.parametrize("workers,share", [(2, "0.5"), (4, "0.25"), (3, "0.9")])
def test_fractional_gpus_for_several_policy_ranks_are_refused_naming_the_flag_and_the_way_out(workers, share):
    cfg = from_args(["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", share,
                     "--actor.num_workers", str(workers), "--rollout.batch_size", "12"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert msg.startswith(f"invalid config: --actor.num_gpus_per_worker: {share} with {workers} policy ranks")
    assert "Duplicate GPU" in msg and "whole GPU (1)" in msg and "--ref.num_gpus" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("workers,share", [(1, "0.5"), (2, "1"), (2, "2"), (4, "0")])
def test_whole_gpus_per_rank_or_a_single_fractional_rank_pass(workers, share):
    validate(from_args(["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", share,
                        "--actor.num_workers", str(workers)]))  # fmt: skip
