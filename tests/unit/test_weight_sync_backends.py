"""The weight sync's choices that a CPU machine can check: backend, the device check, and what the NCCL branch
of `WeightSyncGroup` builds and calls (vLLM's StatelessProcessGroup and PyNcclCommunicator, faked here: they need
CUDA). The gloo branch is the real thing, on one rank."""

import time

import pytest
import torch
import torch.distributed as dist

from entropy_openrlhf.sync import group as weight_sync
from entropy_openrlhf.sync.group import (
    HANDSHAKE,
    WeightSyncError,
    WeightSyncGroup,
    check_devices,
    choose_backend,
)


def test_nccl_only_when_every_member_has_cuda():
    assert choose_backend(policy_on_gpu=True, engines_on_gpu=True) == "nccl"
    assert choose_backend(policy_on_gpu=True, engines_on_gpu=False) == "gloo"
    assert choose_backend(policy_on_gpu=False, engines_on_gpu=True) == "gloo"
    assert choose_backend(policy_on_gpu=False, engines_on_gpu=False) == "gloo"


WHERE = ["node 10.0.0.1", "node 10.0.0.2", "node 10.0.0.3"]


def test_a_member_without_the_gpu_its_flags_reserve_is_named_in_one_line():
    with pytest.raises(WeightSyncError, match=r"^rollout engine 1 \(node 10\.0\.0\.3\) has no CUDA device.*"
                       r"--rollout\.num_gpus_per_engine 1 ") as error:  # fmt: skip
        check_devices(policy_gpus=1, policy_cuda=True, engine_gpus=1, engines_cuda=[True, False], where=WHERE)
    assert "\n" not in str(error.value)
    with pytest.raises(WeightSyncError, match=r"^policy rank 0 \(node 10\.0\.0\.1\).*--actor\.num_gpus_per_worker 1"):
        check_devices(policy_gpus=1, policy_cuda=False, engine_gpus=1, engines_cuda=[True, True], where=WHERE)
    # as configured: nothing to say (CPU everywhere, GPUs everywhere, or a CPU policy with GPU engines)
    check_devices(policy_gpus=0, policy_cuda=False, engine_gpus=0, engines_cuda=[False, False], where=WHERE)
    check_devices(policy_gpus=1, policy_cuda=True, engine_gpus=1, engines_cuda=[True, True], where=WHERE)
    check_devices(policy_gpus=0, policy_cuda=False, engine_gpus=1, engines_cuda=[True, True], where=WHERE)


class FakeStatelessGroup:
    def __init__(self, *, rank: int, world_size: int, store):
        self.rank, self.world_size, self.store = rank, world_size, store


class FakeCommunicator:
    """Stands in for vLLM's PyNcclCommunicator: records its calls; a receiving rank gets rank 0's value."""

    made: list = []
    disabled = False  # PyNccl's own flag: set when VLLM_DISABLE_PYNCCL is or libnccl does not load

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.broadcasts: list = []
        self.destroyed = 0
        FakeCommunicator.made.append(self)

    def broadcast(self, tensor, src, stream=None):
        self.broadcasts.append((tensor.clone(), src, stream))
        if self.group.rank != src:
            tensor.fill_(HANDSHAKE)

    def destroy(self):
        self.destroyed += 1


class FakeCuda:
    """torch.cuda's streams and events; `done` says whether the queued work has finished."""

    def __init__(self):
        self.done = True
        self.recorded: list = []
        self.emptied = 0
        fake = self

        class Event:
            def record(self, stream):
                fake.recorded.append(stream)

            def query(self):
                return fake.done

        self.Event = Event

    def current_stream(self):
        return "the current stream"

    def empty_cache(self):
        self.emptied += 1


@pytest.fixture
def fake_gpu(monkeypatch):
    FakeCommunicator.made = []
    cuda = FakeCuda()
    monkeypatch.setattr(weight_sync, "_vllm_nccl", lambda: (FakeStatelessGroup, FakeCommunicator))
    monkeypatch.setattr(weight_sync, "_cuda", lambda: cuda)
    monkeypatch.setattr(weight_sync, "_cuda_device", lambda: torch.device("cpu"))  # tensors stay on CPU here
    return cuda


def test_nccl_builds_vllms_stateless_group_and_pynccl_and_broadcasts_on_the_current_stream(fake_gpu):
    group = WeightSyncGroup(dist.HashStore(), rank=2, world_size=3, backend="nccl", timeout_s=5)
    (comm,) = FakeCommunicator.made
    assert group.comm is comm and group.pg is None
    assert (comm.group.rank, comm.group.world_size) == (2, 3)
    assert isinstance(comm.group.store, dist.PrefixStore)  # the group's keys stay apart from anything else
    assert comm.device == torch.device("cpu")  # _cuda_device(): the process's CUDA device on a GPU
    # the handshake: one broadcast from rank 0, waited for with an event on the current stream
    (hello, src, stream), *_ = comm.broadcasts
    assert src == 0 and stream == "the current stream" and fake_gpu.recorded == ["the current stream"]

    received = dict(group.receive([("w", "float32", (2, 3)), ("b", "bfloat16", (4,))]))
    assert received["w"].shape == (2, 3) and received["b"].dtype == torch.bfloat16
    assert all(b[1] == 0 and b[2] == "the current stream" for b in comm.broadcasts)
    group.finish()
    assert fake_gpu.emptied == 0
    group.release_cache()  # after a whole sync, the cached blocks go back to the GPU
    assert fake_gpu.emptied == 1

    group.close()
    assert comm.destroyed == 1  # close aborts the communicator (PyNccl's destroy calls ncclCommAbort)
    group.close()
    assert comm.destroyed == 1
    with pytest.raises(WeightSyncError, match="closed"):
        group.send(torch.ones(1))


def test_a_disabled_pynccl_communicator_is_an_error_not_a_broadcast_that_does_nothing(fake_gpu, monkeypatch):
    monkeypatch.setattr(FakeCommunicator, "disabled", True)
    with pytest.raises(WeightSyncError, match="weight sync rank 1: vLLM's NCCL communicator is disabled"):
        WeightSyncGroup(dist.HashStore(), rank=1, world_size=2, backend="nccl", timeout_s=5)
    (comm,) = FakeCommunicator.made
    assert comm.broadcasts == []  # no handshake was tried against itself
    assert comm.destroyed == 1  # what was built is released, not left to the actor's lifetime


def test_nccl_finish_aborts_the_communicator_at_the_deadline_instead_of_hanging(fake_gpu):
    group = WeightSyncGroup(dist.HashStore(), rank=0, world_size=2, backend="nccl", timeout_s=0.2)
    (comm,) = FakeCommunicator.made
    group.send(torch.arange(4.0))
    assert torch.equal(comm.broadcasts[-1][0], torch.arange(4.0))
    fake_gpu.done = False  # a peer never joins the broadcast: the stream never gets there
    t0 = time.monotonic()
    with pytest.raises(
        WeightSyncError, match=r"weight sync rank 0: the broadcast did not finish within 0.2 s; .*abort"
    ):
        group.finish()
    assert 0.2 <= time.monotonic() - t0 < 10.0  # the upper bound only says it returned, with slack for a busy machine
    assert comm.destroyed == 1 and group.comm is None


def test_gloo_on_cpu_is_a_process_group_of_its_own(monkeypatch):
    monkeypatch.setattr(weight_sync, "_vllm_nccl", lambda: pytest.fail("gloo must not touch vLLM's NCCL classes"))
    monkeypatch.setattr(weight_sync, "_cuda", lambda: pytest.fail("gloo must not touch CUDA"))
    group = WeightSyncGroup(dist.HashStore(), rank=0, world_size=1, backend="gloo", timeout_s=5)
    assert group.comm is None and isinstance(group.pg, dist.ProcessGroupGloo)
    assert group.device == torch.device("cpu") and not dist.is_initialized()  # the default group is untouched
    group.send(torch.ones(3))
    group.finish()  # gloo's calls are synchronous: nothing to wait for
    group.release_cache()  # no CUDA cache to empty
    group.close()
    assert group.pg is None


def test_unknown_backend():
    with pytest.raises(WeightSyncError, match="'mpi'"):
        WeightSyncGroup(dist.HashStore(), rank=0, world_size=1, backend="mpi", timeout_s=1)
