"""The actor groups' generic call (actors/group.py, `ActorGroup.call_all` and company) on a real local Ray, with
stand-in ranks: every rank sees the calls of several driver threads in one order, a failing rank is raised at once,
and a deadline's error names the group, the method and the ranks still running."""

import threading
import time

import pytest
import ray

from entropy_openrlhf.actors.group import ActorGroup

pytestmark = pytest.mark.integration

CALLS_PER_THREAD = 300


@ray.remote
class Rank:
    def __init__(self, rank: int):
        self.rank, self.calls = rank, []

    def ready(self) -> int:
        return self.rank

    def record(self, tag: str) -> int:
        self.calls.append(tag)
        return self.rank

    def seen(self) -> list[str]:
        return self.calls

    def work(self, seconds: float, fail: bool) -> int:
        if fail:
            raise RuntimeError(f"rank {self.rank} lost")
        time.sleep(seconds)
        return self.rank


class Ranks(ActorGroup):
    def __init__(self, n: int):
        super().__init__(n, {"CPU": 0.01}, f"the test group ({n} ranks)", placement_timeout_s=60)
        spawn = lambda i: Rank.options(num_cpus=0.01, scheduling_strategy=self.on_bundle(i)).remote(i)
        self._start(spawn, "ready", self.what, 60)


@pytest.fixture
def ranks(ray_cluster):
    group = Ranks(2)
    yield group
    group.shutdown()


def test_calls_of_two_driver_threads_reach_every_rank_in_one_order(ranks):
    start = threading.Barrier(2)

    def submit(tag: str) -> None:
        start.wait()  # both threads submit at once
        for i in range(CALLS_PER_THREAD):
            ranks.call_all_async("record", f"{tag}{i}")

    threads = [threading.Thread(target=submit, args=(tag,)) for tag in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert ranks.call_all("record", "last", timeout_s=60) == [0, 1]  # answers in rank order, after all the rest
    rank0, rank1 = ranks.call_all("seen", timeout_s=60)
    assert len(rank0) == 2 * CALLS_PER_THREAD + 1
    assert rank0 == rank1  # the same order on both ranks, however the threads interleaved


def test_a_failing_rank_is_raised_at_once_and_a_deadline_names_the_group_the_method_and_the_ranks(ranks):
    t0 = time.monotonic()
    # rank 0 works for 30 s; rank 1 fails at once, and its error comes before rank 0 is done or the deadline passes
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 lost"):
        ranks.call_each("work", [(30.0, False), (0.0, True)], timeout_s=20)
    assert time.monotonic() - t0 < 15

    # rank 0 is still busy for the rest of its 30 s (over 15 s): only rank 1 answers before the deadline, which
    # leaves it 5 s to do so on a loaded machine
    t0 = time.monotonic()
    message = r"^the test group \(2 ranks\): work did not answer within 5 s \(--test\.flag\); rank\(s\) \[0\] of 2"
    with pytest.raises(TimeoutError, match=message + r" still running$"):
        ranks.call_all("work", 0.0, False, timeout_s=5, what="--test.flag")
    assert 5 <= time.monotonic() - t0 < 15


def test_arguments_for_each_rank_must_be_one_per_rank(ranks):
    with pytest.raises(ValueError, match=r"^the test group \(2 ranks\): work got arguments for 1 of 2 ranks$"):
        ranks.call_each("work", [(0.0, False)])
    assert ranks.call_each("work", [(0.0, False), (0.0, False)], timeout_s=60) == [0, 1]
