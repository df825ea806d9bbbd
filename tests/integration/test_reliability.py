"""Faults done for real on a local Ray cluster: rollout engines killed with SIGKILL (mid-generation and idle), an
engine that hangs in generate, a weight sync to an engine that never answers, and a run whose every step has a
non-finite loss.

The kill and the stall are real signals to the engine's process; the tests only choose the moment (the engine is
SIGSTOPped first, so the call it is killed in is certainly in flight)."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from entropy_openrlhf.samples import PromptItem
from entropy_openrlhf.sync.adapter import AdapterSync
from entropy_openrlhf.sync.collective import CollectiveSync
from entropy_openrlhf.sync.object_store import ObjectStoreSync

pytestmark = pytest.mark.integration

VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def engine_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def wait_restarted(actor, old_pid: int, timeout_s: float = 600) -> None:
    """Until Ray has restarted `actor` as a new process (its old one, `old_pid`, was killed)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if engine_pid(actor) != old_pid:
                return
        except ray.exceptions.RayActorError:
            time.sleep(0.5)
    raise TimeoutError(f"the engine killed as pid {old_pid} was not restarted within {timeout_s:.0f} s")


def tokens(samples) -> list[tuple[int, list[int]]]:
    return [(s.prompt_index, s.response_token_ids) for s in samples]


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


LORA_RANK = 8


def engine_options(method: str) -> dict:
    """What the engines need for `method`: the adapter sync serves a LoRA adapter on the base."""
    return {"lora_rank": LORA_RANK} if method == "adapter" else {}


class Weights:
    """How a test gives the engines new weights, by `--sync.method`: object_store loads a perturbed checkpoint;
    collective trains a real DeepSpeed policy one step and broadcasts it (the group then holds no copy, so a
    restarted engine gets a fresh export of the policy and the broadcast group is rebuilt around it); adapter trains
    a LoRA policy one step and sends its adapter (the sync keeps the last one for restarted engines)."""

    def __init__(self, method: str, group, tiny_model: str):
        from safetensors.torch import load_file

        self.method, self.group, self.policy = method, group, None
        self.original = load_file(f"{tiny_model}/model.safetensors")
        self.weight_sync = ObjectStoreSync(group, timeout_s=120)
        if method in ("collective", "adapter"):
            from entropy_openrlhf.actors.policy import PolicyGroup
            from entropy_openrlhf.config import from_args

            # the adapter starts at zero (B = 0): a larger step moves it enough to change sampled tokens
            lora = ["--actor.lora_rank", str(LORA_RANK), "--actor.lr", "0.05"] if method == "adapter" else []
            cfg = from_args(["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3", *lora],
                            {"loss.type": "ppo", "offpolicy.preset": "none"})  # fmt: skip
            self.policy = PolicyGroup(cfg, tiny_model)
            sync = CollectiveSync if method == "collective" else AdapterSync
            self.weight_sync = sync(group, self.policy, timeout_s=120)
            self.weight_sync.setup()

    def sync(self, version: int) -> None:
        if self.method == "object_store":
            self.weight_sync.update_weights(perturbed(self.original, version), version)
            return
        from tests.integration.test_policy import fixed_batch

        self.policy.train_step(fixed_batch(seed=version), version)
        if self.method == "collective":
            self.weight_sync.update_weights(version)
        else:
            self.weight_sync.publish(version)
            self.weight_sync.make_current()

    def close(self) -> None:
        if self.policy is not None:
            self.policy.shutdown()


HUNG_DEADLINE_S = 20.0  # --rollout.generate_timeout_s while an engine hangs


# Every sync method: the object store reloads a restarted engine from the chunks it keeps; the collective sync
# re-exports from the policy and rebuilds its process group on every member (step 4 shows a broadcast reaching
# the restarted engines through it); the adapter sync gives it the adapter it keeps. Step 1 kills an engine while it
# generates (the group reloads it and generates its prompts again), step 2 one that the next sync then finds dead:
# the sync still completes, and the dead engine gets the weights once restarted. Those are the two ways each method
# reloads an engine, so every method runs them. The other steps exercise the group's own paths, the same for every
# method except the collective sync's rebuilt group, so only the collective run takes them (a vLLM restart each on
# a 2-core machine): step 0, an engine restarted before the first sync; step 3, one restarted idle and found stale
# before a generation; step 4, a broadcast through the rebuilt group; step 5, an engine frozen in generate, killed
# by the group past --rollout.generate_timeout_s (the deadline kills engines on purpose, so a collective run must
# survive the restart too).
@pytest.mark.timeout(1200)  # up to five engine kills, each restart a vLLM start on a loaded 2-core machine
@pytest.mark.parametrize("method", ["object_store", "collective", "adapter"])
def test_killed_engine_is_restarted_reloaded_and_its_prompts_generated_again(ray_cluster, tiny_model, method):
    import ray

    from entropy_openrlhf.actors.rollout import RolloutGroup

    prompts = [PromptItem(index=i, prompt=CHAT.format(f"What is {i} + {i + 3}?"), label="") for i in range(4)]
    sampling = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=32, seed=11)
    group = RolloutGroup(
        tiny_model, num_engines=2, num_cpus_per_engine=1, seed=0, max_model_len=512, **engine_options(method)
    )
    weights = None
    try:
        weights = Weights(method, group, tiny_model)
        from_disk = group.generate(prompts, policy_version=0, **sampling)
        every_step = method == "collective"

        if every_step:
            # 0. engine 1 dies while idle before the first sync, and is back before it: it holds version 0, as the
            # group does, so only its new process tells the restart (collective: it is in no broadcast group; seen
            # in a run whose engine was OOM-killed during its first step)
            pid = engine_pid(group.actors[1])
            os.kill(pid, signal.SIGKILL)
            wait_restarted(group.actors[1], pid)
        weights.sync(1)
        # the collective sync rebuilt its group for the engine restarted in step 0
        early = 1 if every_step else 0
        assert group.restarts == early
        assert ray.get([a.get_version.remote() for a in group.actors]) == [1, 1]
        undisturbed = group.generate(prompts, policy_version=1, **sampling)
        assert tokens(undisturbed) != tokens(from_disk)  # a restarted engine that kept the disk weights would show

        # 1. engine 0 dies while its half of the prompts is in flight
        pid = engine_pid(group.actors[0])
        os.kill(pid, signal.SIGSTOP)  # frozen: the call below reaches it but cannot finish
        result: dict = {}

        def generate() -> None:
            result["out"] = group.generate(prompts, policy_version=1, **sampling)

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(2.0)
        assert worker.is_alive()  # the generation is in flight
        os.kill(pid, signal.SIGKILL)
        worker.join(timeout=600)
        assert not worker.is_alive()
        got = result["out"]
        assert group.restarts == early + 1 and engine_pid(group.actors[0]) != pid
        # the lost prompts were generated again, with the version-1 weights reloaded (per-prompt seeds: same tokens)
        assert tokens(got) == tokens(undisturbed)
        assert [s.policy_version for s in got] == [1] * len(got)
        assert ray.get([a.get_version.remote() for a in group.actors]) == [1, 1]

        # 2. engine 1 dies while idle; the next call is a weight sync, which still reaches every engine
        os.kill(engine_pid(group.actors[1]), signal.SIGKILL)
        time.sleep(1.0)
        weights.sync(2)
        assert group.restarts == early + 2
        assert ray.get([a.get_version.remote() for a in group.actors]) == [2, 2]
        ids = ([[1, 5, 6, 7, 8]], [[20, 30, 40, 50, 60, 70]])
        per_engine = ray.get([a.sequence_log_probs.remote(*ids) for a in group.actors])
        assert per_engine[0] == per_engine[1]  # the restarted engine holds the same version-2 weights

        if not every_step:
            return  # the object store's and the adapter's reload paths are done (the finally block cleans up)
        # 3. engine 0 dies while idle and is back (from the disk weights) before the next generation
        want = group.generate(prompts, policy_version=2, **sampling)
        pid = engine_pid(group.actors[0])
        os.kill(pid, signal.SIGKILL)
        wait_restarted(group.actors[0], pid)
        assert ray.get(group.actors[0].get_version.remote()) == 0  # restarted from disk
        got = group.generate(prompts, policy_version=2, **sampling)
        assert group.restarts == early + 3
        assert tokens(got) == tokens(want)  # it refused to generate with stale weights and was reloaded first
        assert ray.get([a.get_version.remote() for a in group.actors]) == [2, 2]

        # 4. the next sync reaches both restarted engines (collective: through the rebuilt group)
        weights.sync(3)
        assert ray.get([a.get_version.remote() for a in group.actors]) == [3, 3]
        per_engine = ray.get([a.sequence_log_probs.remote(*ids) for a in group.actors])
        assert per_engine[0] == per_engine[1]
        if weights.policy is not None:  # and they hold the policy's weights
            policy_lp = weights.policy.call_all("forward_log_probs", *ids)[0]
            assert max(abs(a - b) for a, b in zip(per_engine[0][0], policy_lp[0])) < 1e-3
        # one per sync that found restarted engines (0, 2 and 4): a restart found while generating (1, 3) is
        # reloaded at once and rejoins the group at the next sync, on the trainer thread
        assert weights.weight_sync.rebuilds == 3
        assert group.restarts == early + 3

        # 5. engine 0 hangs in generate, alive but never answering: nothing tells Ray, only the deadline can
        hung_prompts = [PromptItem(index=i, prompt=CHAT.format(f"What is {i} * 2?"), label="") for i in range(3)]
        hung_sampling = dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=5)
        group.generate_timeout_s = HUNG_DEADLINE_S
        want = group.generate(hung_prompts, policy_version=3, **hung_sampling)
        restarts, rebuilds = group.restarts, weights.weight_sync.rebuilds
        pid = engine_pid(group.actors[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = group.generate(hung_prompts, policy_version=3, **hung_sampling)
            waited = time.monotonic() - t0
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert waited >= HUNG_DEADLINE_S
        assert group.restarts == restarts + 1 and engine_pid(group.actors[0]) != pid
        assert tokens(got) == tokens(want)  # regenerated with the version-3 weights reloaded into the new engine
        assert [s.policy_version for s in got] == [3] * len(got)
        weights.sync(4)  # the next sync reaches the new engine through the rebuilt group
        assert group.generate(hung_prompts, policy_version=4, **hung_sampling)
        assert ray.get([a.get_version.remote() for a in group.actors], timeout=60) == [4, 4]
        assert weights.weight_sync.rebuilds == rebuilds + 1
    finally:
        if weights is not None:
            weights.close()
        group.shutdown()


# ------------------------------------------------------------------------------------------ through the trainer


class Recorder:
    """Takes the tracker's place: keeps what the trainer logs, and runs `on_step[step]` once that step is logged.
    Given a real `tracker`, it passes everything on to it too (W&B and metrics.jsonl)."""

    def __init__(self, on_step: dict | None = None, tracker=None):
        self.metrics: dict[int, dict] = {}
        self.samples: dict[int, list] = {}
        self.on_step = on_step or {}
        self.tracker = tracker

    def log(self, metrics: dict, step: int) -> None:
        self.metrics[step] = dict(metrics)
        if self.tracker is not None:
            self.tracker.log(metrics, step)
        if step in self.on_step:
            self.on_step[step]()

    def log_samples(self, samples: list, step: int) -> None:
        self.samples[step] = list(samples)
        if self.tracker is not None:
            self.tracker.log_samples(samples, step)


def make_trainer(tmp_path: Path, *flags: str):
    from entropy_openrlhf.config import from_args
    from entropy_openrlhf.pipeline.main import prepare
    from entropy_openrlhf.pipeline.trainer import Trainer

    cfg = from_args(
        ["--preset", "smoke", "--train.output_dir", str(tmp_path / "run"), "--reward.verifier", VERIFIER,
         "--ref.enabled", "false", *flags]
    )  # fmt: skip
    model_path, train_items, test_items = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trainer.start_groups()
    return cfg, model_path, trainer


# With collective (the default sync), the restart happens while the trainer thread trains and broadcasts, so the
# policy's re-export and the group's rebuild run alongside the trainer's own calls to the policy; with adapter (a
# LoRA policy), the producer's adapter load is what the engine is frozen in or about to run. The collective run is
# also the pipeline's run with that sync (asynchronous, logged through a real tracker): its timings and metrics.
# The object store's reload runs on the producer thread as the adapter's does, and is the killed-engine test's above.
@pytest.mark.parametrize("method", ["collective", "adapter"])
def test_run_goes_on_when_an_engine_is_killed(ray_cluster, tmp_path, method):
    import json

    import ray

    lora = ["--actor.lora_rank", str(LORA_RANK)] if method == "adapter" else []
    cfg, _, trainer = make_trainer(
        tmp_path, "--train.num_steps", "4", "--async.max_staleness", "1", "--sync.method", method, *lora
    )
    pid = engine_pid(trainer.rollout.actors[0])

    def kill() -> None:
        # right after step 0 the producer syncs version 1 and generates: freeze the engine in that, then kill it
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(2.0, os.kill, (pid, signal.SIGKILL)).start()

    tracker = None
    if method == "collective":
        from entropy_openrlhf.pipeline.tracking import Tracker

        tracker = Tracker("test", "collective", cfg.flatten(), cfg.train.output_dir)
    recorder = Recorder({0: kill}, tracker)
    try:
        if method == "collective":
            assert isinstance(trainer.sync, CollectiveSync)
        history = trainer.run(recorder)
        assert [h["step"] for h in history] == [0, 1, 2, 3]  # no step lost, none repeated
        if method == "collective":
            for h in history:
                assert h["async/staleness_max"] <= 1
                assert h["time/sync"] > 0 and h["time/sync_wait"] >= 0
            # the collective path leaves nothing for the producer to load: the engines already hold the last weights
            assert trainer.sync.engine_version == 4
        assert recorder.metrics[3]["rollout/engine_restarts"] == 1.0
        assert engine_pid(trainer.rollout.actors[0]) != pid
        per_step = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        seen: set[int] = set()
        for step, samples in recorder.samples.items():
            assert len(samples) == per_step
            prompts = [s.prompt_index for s in samples]
            assert all(prompts.count(p) == cfg.rollout.n_samples_per_prompt for p in prompts)
            assert not seen & set(prompts)  # every batch has fresh prompts: nothing generated twice into a batch
            seen |= set(prompts)
            assert all(step - 1 <= s.policy_version <= step for s in samples)
        # the restarted engine holds the trainer's newest weights, not the initial ones it loaded from disk
        trainer.sync.make_current()
        assert ray.get(trainer.rollout.actors[0].get_version.remote()) == trainer.rollout.version == 4
        prompt_ids, response_ids = [[1, 5, 6, 7, 8]], [[20, 30, 40, 50, 60, 70]]
        engine_lp = trainer.rollout.sequence_log_probs(prompt_ids, response_ids)[0]
        policy_lp = trainer.policy.call_all("forward_log_probs", prompt_ids, response_ids)[0][0]
        assert max(abs(a - b) for a, b in zip(engine_lp, policy_lp)) < 1e-3
    finally:
        trainer.shutdown_groups()
        if tracker is not None:
            tracker.finish()
    if tracker is not None:  # every step's row in metrics.jsonl, each metric defined in docs/guides/metrics.md
        from tests.integration.test_pipeline import assert_documented

        lines = [json.loads(x) for x in tracker.jsonl_path.read_text().splitlines()]
        assert [x["step"] for x in lines] == [0, 1, 2, 3]
        assert_documented({k for line in lines for k in line if k != "step"})


# The adapter's load runs in the producer's thread, the broadcast in the trainer's: the run fails from either. The
# adapter run streams partial rollouts: its load then runs in the streaming producer's worker thread, and the
# producer, leaving on the error, must not wait for the frozen engine's answers (it once held the error 120 s). The
# object store's load runs in the producer thread as well; its own deadline is tests/integration/test_rollout.py's.
@pytest.mark.parametrize("method", ["collective", "adapter"])
def test_stalled_weight_sync_fails_the_run_within_the_timeout(ray_cluster, tmp_path, method):
    timeout_s = 5.0
    lora = ["--actor.lora_rank", str(LORA_RANK), "--rollout.mode", "partial"] if method == "adapter" else []
    _, _, trainer = make_trainer(
        tmp_path, "--train.num_steps", "3", "--async.max_staleness", "0", "--sync.timeout_s", str(timeout_s),
        "--sync.method", method, *lora,
    )  # fmt: skip
    pid = engine_pid(trainer.rollout.actors[0])
    train_step = trainer.policy.train_step
    frozen: dict[str, float] = {}

    def freeze_then_train(samples, step, strength_scale=1.0, entropy_coef=None):
        # batch 0 is generated; the engine now stops answering, so the sync of version 1 after this step stalls
        if step == 0:
            os.kill(pid, signal.SIGSTOP)
            frozen["at"] = time.monotonic()
        return train_step(samples, step, strength_scale, entropy_coef)

    trainer.policy.train_step = freeze_then_train
    try:
        # the producer hands its error over as a RuntimeError; the trainer thread's broadcast raises its own
        with pytest.raises((RuntimeError, TimeoutError)) as error:
            trainer.run(Recorder())
        waited = time.monotonic() - frozen["at"]
        message = f"{type(error.value).__name__}: {error.value}"
        assert "WeightSyncTimeoutError" in message
        what = "adapter sync" if method == "adapter" else "weight sync"
        assert f"{what} to policy version 1 timed out after {timeout_s:.1f} s: rollout engine(s) [0] of 1" in message
        assert timeout_s <= waited < timeout_s + 60  # the sync's own deadline ended the run; no hang
    finally:
        os.kill(pid, signal.SIGCONT)
        trainer.shutdown_groups()


def test_a_verifier_failing_on_every_response_stops_the_run(ray_cluster, tmp_path):
    # it raises on every response: without the stop, every reward would be 0 and the run would train on nothing
    failing = VERIFIER.replace(":digit_share", ":needs_solution")
    _, _, trainer = make_trainer(
        tmp_path, "--train.num_steps", "4", "--async.max_staleness", "0", "--reward.verifier", failing,
        "--reward.max_failed_steps", "2",
    )  # fmt: skip
    recorder = Recorder()
    try:
        with pytest.raises(RuntimeError) as error:
            trainer.run(recorder)
        message = str(error.value)
        assert "raised or timed out on every response of 2 consecutive RL steps" in message
        assert "stopping at step 1 (--reward.max_failed_steps). Its last error: KeyError: 'solution'" in message
        assert list(recorder.metrics) == [0]  # step 1 stopped the run before it was logged
        logged = recorder.metrics[0]
        assert logged["reward/scored_frac"] == 0.0 and logged["reward/mean"] == 0.0
        assert logged["reward/errors"] == trainer.cfg.rollout.batch_size * trainer.cfg.rollout.n_samples_per_prompt
    finally:
        trainer.shutdown_groups()


def test_consecutive_non_finite_steps_stop_the_run(ray_cluster, tmp_path):
    from safetensors.torch import load_file

    # beta = 1e39 overflows to inf in the fp32 KL-Cov loss: inf * |log-ratio| is NaN where the ratio is 1, inf
    # elsewhere, so every optimizer step of every RL step has a non-finite loss and gradient
    _, model_path, trainer = make_trainer(
        tmp_path, "--train.num_steps", "4", "--async.max_staleness", "0", "--loss.kl_cov.coef", "1e39",
        "--train.max_nonfinite_steps", "2",
    )  # fmt: skip
    recorder = Recorder()
    try:
        with pytest.raises(RuntimeError, match=r"^2 consecutive RL steps had optimizer steps skipped") as error:
            trainer.run(recorder)
        assert "stopping at step 1 (--train.max_nonfinite_steps)" in str(error.value)
        assert list(recorder.metrics) == [0]  # step 1 stopped the run before it was logged
        assert recorder.metrics[0]["train/skipped_steps"] == 2.0  # both mini-batches of step 0
        initial = load_file(str(Path(model_path) / "model.safetensors"))
        now = trainer.policy.call_all("export_weights")[0]
        assert all(torch.equal(initial[k], now[k]) for k in initial)  # no skipped step touched the weights
    finally:
        trainer.shutdown_groups()
