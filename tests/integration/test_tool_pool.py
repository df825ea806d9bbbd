"""The tool pool (entropy_openrlhf/tools/pool.py) on a real local Ray: calls run in parallel on its workers, a call
that times out and one whose code crashes come back as observations, a worker that dies or hangs gives its call an
error observation and is replaced, and the pool keeps serving through all of it."""

import asyncio
import os
import signal
import time

import pytest
import ray

from entropy_openrlhf.tools.pool import ToolPool
from entropy_openrlhf.tools.sandbox import sandbox_available

pytestmark = pytest.mark.integration

REASON = sandbox_available()
MODE = "bwrap" if REASON is None else "none"  # the pool's own behaviour is the same; bwrap is tested where it runs


@pytest.fixture(scope="module")
def pool(ray_cluster):
    p = ToolPool(num_workers=2, sandbox=MODE, timeout_s=1.5, memory_mb=256, num_cpus_per_worker=0.5,
                 answer_grace_s=3.0, start_timeout_s=120)  # fmt: skip
    yield p
    p.shutdown()


def busy_slots(pool) -> list[int]:
    return [i for i in range(len(pool.workers)) if i not in pool._free]


def test_calls_run_in_parallel_and_in_order(pool):
    pool.run_many(["pass", "pass"])  # both workers warm
    start = time.monotonic()
    results = pool.run_many([f"import time\ntime.sleep(0.6)\nprint({i})" for i in range(4)])
    elapsed = time.monotonic() - start
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"] and all(r.ok for r in results)
    assert elapsed < 4 * 0.6  # two at a time on two workers: about 1.2 s, not 2.4 s


def test_a_timeout_and_a_crash_are_observations(pool):
    hang, crash, fine = pool.run_many(["while True:\n    pass", "import os\nos.abort()", ("print(input())", "ok")])
    assert hang.timed_out and hang.exit_code == 137
    assert crash.exit_code == 134 and not crash.timed_out  # 128 + SIGABRT
    assert fine.ok and fine.stdout == "ok\n"


def test_a_killed_worker_gives_an_error_observation_and_is_replaced(pool):
    before = pool.stats()["replaced"]
    victim = {}

    async def scenario():
        slow = asyncio.create_task(pool.run("import time\ntime.sleep(1.2)\nprint('never')"))
        await asyncio.sleep(0.5)  # the call is running
        [victim["slot"]] = busy_slots(pool)
        victim["actor"] = pool.workers[victim["slot"]]
        ray.kill(victim["actor"], no_restart=True)
        return await slow, await asyncio.gather(*(pool.run(f"print({i})") for i in range(4)))

    killed, after = asyncio.run(scenario())
    assert killed.exit_code == -1 and "died" in killed.stderr and not killed.ok, killed
    assert [r.stdout for r in after] == ["0\n", "1\n", "2\n", "3\n"]
    assert pool.workers[victim["slot"]] is not victim["actor"] and pool.stats()["replaced"] == before + 1
    assert pool.run_many(["print('served by the new worker')"] * 2)[0].ok


def test_a_worker_that_stops_answering_is_replaced(pool):
    before = pool.stats()["replaced"]
    pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in pool.workers])
    stopped = {}

    async def scenario():
        stuck = asyncio.create_task(pool.run("import time\ntime.sleep(0.3)"))
        await asyncio.sleep(0.1)
        # SIGSTOP the worker holding the call: it answers nothing, past the sandbox's own timeout
        [slot] = busy_slots(pool)
        stopped["pid"] = pids[slot]
        os.kill(pids[slot], signal.SIGSTOP)
        return await stuck

    try:
        stuck = asyncio.run(scenario())
    finally:
        try:
            os.kill(stopped["pid"], signal.SIGCONT)  # killed by the pool already, as a rule
        except ProcessLookupError:
            pass
    assert stuck.timed_out and stuck.exit_code == -1 and "did not answer within 4.5 s" in stuck.stderr, stuck
    assert pool.stats()["replaced"] == before + 1
    assert [r.stdout for r in pool.run_many(["print(1)", "print(2)"])] == ["1\n", "2\n"]
