"""Which device a policy rank or the reference actor takes, and the DS_ACCELERATOR checks: pure functions, every case
a Ray cluster can hand an actor (no GPU needed)."""

import pytest

from entropy_openrlhf.actors.devices import accelerator_error, local_device_index


def test_ray_sets_cuda_visible_devices_so_the_actor_s_gpu_is_device_zero():
    # Ray gave GPU 5 and set CUDA_VISIBLE_DEVICES=5 in the actor: the process sees one device, index 0
    assert local_device_index([5], "5", noset=False) == 0
    assert local_device_index(["3"], "3", noset=False) == 0  # ids may come as strings
    assert local_device_index([2, 3], "2,3", noset=False) == 0  # a rank uses the first of its GPUs


def test_with_noset_the_device_is_the_physical_id_ray_gave():
    # every process sees all GPUs: rank on Ray GPU 6 must use cuda:6, not cuda:0 (which another rank holds)
    assert local_device_index([6], None, noset=True) == 6
    assert local_device_index([6], "", noset=True) == 6
    assert local_device_index(["1"], None, noset=True) == 1


def test_with_noset_and_a_raylet_device_list_the_index_is_the_position_in_it():
    # raylet started with CUDA_VISIBLE_DEVICES=4,5,6,7: Ray's ids are 4..7 and torch numbers them 0..3
    assert local_device_index([6], "4,5,6,7", noset=True) == 2
    with pytest.raises(ValueError, match="Ray GPU id 2 is not in CUDA_VISIBLE_DEVICES='4,5'"):
        local_device_index([2], "4,5", noset=True)


def test_no_gpu_from_ray_means_the_cpu_whatever_the_node_has():
    assert local_device_index([], None, noset=False) is None
    assert local_device_index([], "0,1,2,3", noset=False) is None  # Ray 2.60 leaves GPU-less actors all GPUs
    assert local_device_index([], None, noset=True) is None


def test_a_cpu_accelerator_leaked_onto_a_gpu_rank_fails_naming_the_variable_and_node():
    error = accelerator_error(0, True, "cpu", "gpu-node-3")
    assert error.startswith("DS_ACCELERATOR=cpu on node gpu-node-3") and "\n" not in error


def test_a_cuda_accelerator_without_cuda_fails_naming_the_variable_and_node():
    error = accelerator_error(None, False, "cuda", "cpu-node-1")
    assert error.startswith("DS_ACCELERATOR=cuda on node cpu-node-1") and "\n" not in error


def test_a_gpu_from_ray_that_torch_cannot_see_fails():
    assert "torch sees no CUDA device" in accelerator_error(0, False, None, "n")


@pytest.mark.parametrize(
    "index,cuda,ds",
    [(None, False, "cpu"), (None, False, None), (0, True, None), (0, True, "cuda"), (3, True, "cuda")],
)
def test_consistent_set_ups_pass(index, cuda, ds):
    assert accelerator_error(index, cuda, ds, "n") == ""
