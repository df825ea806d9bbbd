"""A killed rollout engine leaves no process behind: with vLLM's engine core in its own process (as on GPUs), Ray's
kill of the engine actor orphans it, and the engine's next incarnation (or the group's shutdown) must end it."""

import psutil
import pytest


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(900)  # two engine starts with a separate engine core on a loaded 2-core machine
def test_a_killed_engine_leaves_no_process_behind(ray_cluster, tiny_model):
    import ray

    from entropy_openrlhf.actors.rollout import RolloutGroup

    group = RolloutGroup(tiny_model, num_engines=1, max_model_len=256, env_vars={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        old = [pid for pid, _ in ray.get(group.actors[0].processes.remote(), timeout=60)]
        assert len(old) >= 2, f"expected vLLM's engine core as a child process of the engine, got {old}"
        # as --rollout.generate_timeout_s does: kill for Ray to restart
        ray.kill(group.actors[0], no_restart=False)
        # ray.kill returns before the process ends: on a loaded machine the old incarnation can still answer the
        # ping below, so wait for the engine's own process (the tree's root) to end first
        try:
            psutil.Process(old[0]).wait(timeout=120)
        except psutil.NoSuchProcess:
            pass
        group._wait_answering(0, "was killed by the test")  # the new incarnation has started vLLM
        assert [pid for pid in old if running(pid)] == []
        new = [pid for pid, _ in ray.get(group.actors[0].processes.remote(), timeout=60)]
        assert len(new) >= 2 and not set(new) & set(old)
    finally:
        group.shutdown()
    assert [pid for pid in new if running(pid)] == []  # the shutdown's kill left nothing either
