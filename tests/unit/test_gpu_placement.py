"""GPU placement decisions that only a GPU cluster would exercise, checked as pure functions and config checks
(no GPU needed): fractional policy ranks, the reference's hardware, the engines' visible devices, where an actor
is reported to run."""

import os

import pytest

from entropy_openrlhf.actors.devices import NOSET_VISIBLE_DEVICES as POLICY_NOSET
from entropy_openrlhf.actors.devices import engine_visible_devices
from entropy_openrlhf.actors.engine import NOSET_VISIBLE_DEVICES as ROLLOUT_NOSET
from entropy_openrlhf.cluster_fit import group_needs
from entropy_openrlhf.config import ConfigError, from_args, reference_gpus, validate
from entropy_openrlhf.resources import group_resources

GPU_POLICY = ["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "1"]


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
    ref_gpus = "0" if share == "0" else "1"
    validate(from_args(["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", share,
                        "--actor.num_workers", str(workers), "--ref.num_gpus", ref_gpus]))  # fmt: skip


# ---------------------------------------------------------------------------------------------- the reference

REF_ON = ["--ref.enabled", "true"]  # the reference runs (by default only a KL term starts it): where does it go?


def test_by_default_the_reference_follows_the_policy_onto_gpus():
    cfg = from_args([*GPU_POLICY, *REF_ON])
    validate(cfg)
    assert reference_gpus(cfg) == 1.0
    # every place that reserves or checks resources counts that GPU: the actor's options, the fit check, the docs
    assert group_resources(cfg)["reference"]["GPU"] == 1.0
    assert [g.bundle["GPU"] for g in group_needs(cfg) if g.name == "reference"] == [1.0]


def test_the_reference_takes_one_rank_s_share_at_most_one_gpu():
    assert reference_gpus(from_args([*REF_ON, "--actor.num_gpus_per_worker", "0.5"])) == 0.5
    assert reference_gpus(from_args([*REF_ON, "--actor.num_gpus_per_worker", "2"])) == 1.0  # one forward: one device


def test_by_default_the_reference_stays_on_the_cpu_with_cpu_policy_ranks():
    cfg = from_args(REF_ON)
    validate(cfg)
    assert reference_gpus(cfg) == 0.0 and group_resources(cfg)["reference"]["GPU"] == 0.0


def test_a_reference_on_the_cpu_beside_gpu_policy_ranks_is_refused_naming_the_flag():
    with pytest.raises(ConfigError) as e:
        validate(from_args([*GPU_POLICY, *REF_ON, "--ref.num_gpus", "0"]))
    msg = str(e.value)
    assert msg.startswith("invalid config: --ref.num_gpus: 0 puts the reference model on the CPU in fp32")
    assert "--ref.enabled false" in msg and "-1 (auto" in msg and "\n" not in msg


def test_an_explicit_reference_gpu_share_and_a_disabled_reference_are_taken_as_given():
    assert reference_gpus(from_args([*GPU_POLICY, *REF_ON, "--ref.num_gpus", "0.5"])) == 0.5
    cfg = from_args([*GPU_POLICY, "--ref.enabled", "false", "--ref.num_gpus", "0"])
    validate(cfg)
    assert reference_gpus(cfg) == 0.0 and "reference" not in group_resources(cfg)


# ---------------------------------------------------------------------------------------------- engines' devices


def test_with_noset_an_engine_sees_only_the_gpus_ray_gave_it():
    # every engine would otherwise see the whole node and vLLM would take cuda:0 (policy rank 0's, say)
    assert engine_visible_devices([3], None, noset=True) == "3"
    assert engine_visible_devices(["6", "7"], "", noset=True) == "6,7"  # TP 2: both, in Ray's order
    # raylet started with its own list: Ray's ids are physical ids from it, which is what the variable takes
    assert engine_visible_devices([5, 4], "4,5,6,7", noset=True) == "5,4"


def test_an_id_outside_the_raylet_s_device_list_fails_naming_it():
    with pytest.raises(ValueError, match="Ray GPU id 2 is not in CUDA_VISIBLE_DEVICES='4,5'"):
        engine_visible_devices([4, 2], "4,5", noset=True)


def test_without_noset_the_engine_keeps_what_ray_set_and_outside_ray_what_it_has():
    assert engine_visible_devices([3], "3", noset=False) is None  # Ray already narrowed it
    assert engine_visible_devices(None, "0,1,2,3", noset=True) is None  # in-process (a benchmark): no Ray actor
    assert engine_visible_devices(None, None, noset=False) is None


def test_an_engine_actor_without_gpus_sees_none_whatever_ray_left_it():
    # Ray 2.60 leaves a GPU-less actor the node's CUDA_VISIBLE_DEVICES (or none at all, meaning every GPU)
    assert engine_visible_devices([], "0,1,2,3", noset=False) == ""
    assert engine_visible_devices([], None, noset=False) == ""
    assert engine_visible_devices([], "0,1,2,3", noset=True) == ""


def test_the_engine_reads_the_same_variable_as_the_policy_ranks():
    assert ROLLOUT_NOSET == POLICY_NOSET == "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def test_a_noset_engine_sets_its_devices_before_cuda_or_vllm_start(monkeypatch):
    """RolloutEngine's constructor, up to the first CUDA query: the variable must already hold the engine's GPUs."""
    import ray

    from entropy_openrlhf.actors import engine as rollout

    seen = {}

    class Stop(Exception):
        pass

    def first_cuda_query():  # set_cpu_defaults is the first thing that asks torch about CUDA
        seen["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise Stop

    monkeypatch.setenv(ROLLOUT_NOSET, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [6, 7])
    monkeypatch.setattr(rollout, "set_cpu_defaults", first_cuda_query)
    with pytest.raises(Stop):
        rollout.RolloutEngine("unused", tensor_parallel_size=2)
    assert seen["visible"] == "6,7"


# ---------------------------------------------------------------------------------------------- where actors run


def test_an_actor_s_address_is_its_node_s_registered_one():
    from entropy_openrlhf.pipeline.placement import node_addresses

    nodes = [  # as ray.nodes() lists them (other keys left out)
        {"NodeID": "aa", "NodeManagerAddress": "198.18.0.1", "Alive": True},
        {"NodeID": "bb", "NodeManagerAddress": "198.18.0.2", "Alive": True},
    ]
    assert node_addresses(["bb", "aa", "bb"], nodes) == ["198.18.0.2", "198.18.0.1", "198.18.0.2"]
    with pytest.raises(RuntimeError, match="Ray node cc is not among the cluster's 2 node"):
        node_addresses(["aa", "cc"], nodes)
