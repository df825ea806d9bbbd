"""The DeepSpeed policy group on a fixed batch: real Ray actors, gloo, ZeRO."""

import random
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.policy import PolicyGroup, TrainSample
from entropy_openrlhf.algorithms.entropy_control import MEASURE
from entropy_openrlhf.config import from_args

pytestmark = pytest.mark.integration


def fixed_batch(n: int = 16, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        response = [rng.randrange(3, 300) for _ in range(rng.randint(4, 12))]
        out.append(
            TrainSample(
                prompt_ids=[1, 5 + i % 4, 6, 7],
                response_ids=response,
                advantage=rng.gauss(0.0, 1.0),
                rollout_log_probs=[-5.8] * len(response),
            )
        )
    return out


def train_once(model_path: str, loss: str, workers: int = 1, steps: int = 1, scope: str = "micro_batch", zero=2):
    cfg = from_args(
        [
            "--preset", "smoke",
            "--actor.num_workers", str(workers),
            "--actor.zero_stage", str(zero),
            "--actor.micro_batch_size", "2",
            "--loss.scope", scope,
            "--actor.lr", "1e-3",
            "--async.is_correction", "off",
        ],
        {"loss.type": loss, **({"loss.clip_low": 1.0, "loss.clip_high": 1.0} if loss == "clip_cov" else {})},
    )  # fmt: skip
    cfg.loss.kl_cov.ratio = 0.1
    cfg.loss.clip_cov.ratio = 0.1
    cfg.loss.clip_cov.lb, cfg.loss.clip_cov.ub = -1e9, 1e9  # tiny random models have tiny covariances
    group = PolicyGroup(cfg, model_path)
    try:
        metrics = [group.train_step(fixed_batch(), step) for step in range(steps)]
        return group.call_all("export_weights")[0], metrics
    finally:
        group.shutdown()


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_clip_cov_and_kl_cov_change_the_update_relative_to_grpo(ray_cluster, tiny_model):
    grpo, _ = train_once(tiny_model, "ppo")
    kl_cov, kl_metrics = train_once(tiny_model, "kl_cov")
    clip_cov, clip_metrics = train_once(tiny_model, "clip_cov")
    assert kl_metrics[0]["loss/kl_cov_frac"] > 0
    assert clip_metrics[0]["loss/clip_cov_frac"] > 0
    assert max_diff(grpo, kl_cov) > 1e-6
    assert max_diff(grpo, clip_cov) > 1e-6


@pytest.mark.parametrize("scope", ["micro_batch", "global"])
def test_two_data_parallel_ranks_match_one(ray_cluster, tiny_model, scope):
    """The global normaliser makes sharding invisible: 2 ranks x half the batch == 1 rank x the whole batch.
    (PPO: its update does not depend on the selection scope, so the two runs must agree to float precision.)"""
    one, m1 = train_once(tiny_model, "ppo", workers=1, scope=scope)
    two, m2 = train_once(tiny_model, "ppo", workers=2, scope=scope)
    assert m1[0]["loss/policy"] == pytest.approx(m2[0]["loss/policy"], rel=1e-4, abs=1e-6)
    assert max_diff(one, two) < 1e-5


def test_zero3_shards_train_and_export_like_zero2(ray_cluster, tiny_model):
    """The GPU presets use ZeRO-3: parameters sharded over the ranks, gathered one at a time for the HF export.
    Two steps on two ranks must give ZeRO-2's weights, under the HF names, with full (unsharded) shapes."""
    zero2, m2 = train_once(tiny_model, "kl_cov", workers=2, steps=2, zero=2)
    zero3, m3 = train_once(tiny_model, "kl_cov", workers=2, steps=2, zero=3)
    assert zero3.keys() == zero2.keys()
    assert all(zero3[k].shape == zero2[k].shape for k in zero2)
    assert m3[1]["loss/policy"] == pytest.approx(m2[1]["loss/policy"], rel=1e-4, abs=1e-6)
    assert max_diff(zero2, zero3) < 1e-5
    from safetensors.torch import load_file

    initial = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert max_diff(initial, zero3) > 1e-6  # it trained


def test_global_selection_scope_trains_across_ranks(ray_cluster, tiny_model):
    weights, metrics = train_once(tiny_model, "kl_cov", workers=2, scope="global", steps=2)
    assert all(torch.isfinite(w).all() for w in weights.values())
    # 10 % of the valid tokens of each mini-batch, selected once over both ranks
    assert metrics[1]["loss/kl_cov_frac"] == pytest.approx(0.1, abs=0.05)


@pytest.mark.parametrize("dtype, zero", [("fp32", 2), ("bf16", 3)])  # bf16 + ZeRO-3: the GPU presets' path
def test_non_finite_loss_skips_the_step_and_keeps_the_weights(ray_cluster, tiny_model, dtype, zero):
    cfg = from_args(
        ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3", "--model.dtype", dtype,
         "--actor.zero_stage", str(zero)],
        {"loss.type": "ppo"},
    )  # fmt: skip
    group = PolicyGroup(cfg, tiny_model)
    try:
        before = group.call_all("export_weights")[0]
        poisoned = fixed_batch()
        poisoned[0].advantage = float("nan")  # lands in mini-batch 0 only
        metrics = group.train_step(poisoned, 0)
        after_bad = group.call_all("export_weights")[0]
        assert metrics["train/skipped_steps"] == 1.0  # mini-batch 0 skipped, mini-batch 1 applied
        assert all(torch.isfinite(w).all() for w in after_bad.values())
        assert {w.dtype for w in after_bad.values()} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
        assert any(not torch.equal(before[k], after_bad[k]) for k in before)  # mini-batch 1 did move them
        poisoned = [s for s in fixed_batch()]
        for s in poisoned:
            s.advantage = float("nan")
        metrics = group.train_step(poisoned, 1)
        assert metrics["train/skipped_steps"] == 2.0
        after_all_bad = group.call_all("export_weights")[0]
        assert all(torch.equal(after_bad[k], after_all_bad[k]) for k in before)  # nothing moved
    finally:
        group.shutdown()


def test_a_taken_rendezvous_port_is_retried_on_a_new_one(ray_cluster, tiny_model, monkeypatch):
    """The port is picked, then bound by rank 0 later; here another process holds it already (a real EADDRINUSE)."""
    import socket

    import ray

    from entropy_openrlhf.actors import group as policy

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]

    class PickedPorts:  # stands in for the remote task that picks the port on rank 0's node
        def __init__(self):
            self.ports = [taken, policy.free_port("127.0.0.1")]

        def options(self, **_):
            return self

        def remote(self, *_):  # the real task takes `local`
            return ray.put(("127.0.0.1", self.ports.pop(0)))

    picked = PickedPorts()
    monkeypatch.setattr(policy, "_rendezvous_address", picked)
    cfg = from_args(["--preset", "smoke", "--actor.num_workers", "2", "--actor.micro_batch_size", "2"])
    try:
        group = PolicyGroup(cfg, tiny_model)
        try:
            assert picked.ports == []  # the taken port was tried, then the second one
            metrics = group.train_step(fixed_batch(), 0)
            assert metrics["train/tokens"] > 0
        finally:
            group.shutdown()
    finally:
        holder.close()


def _storage(actor) -> dict:
    """Runs inside a PolicyActor (Ray's __ray_call__): how its parameters are stored, and what loading cost."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    model = actor.engine.module
    params = {}
    for name, p in model.named_parameters():
        shard = p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None
        params[name] = {"local": p.numel(), "shard": shard, "full": getattr(p, "ds_numel", p.numel())}
    return {
        "params": params,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "zero3_enabled": is_deepspeed_zero3_enabled(),
        "load": actor.load_info,
    }


def test_zero3_loads_each_rank_s_shard_without_building_the_whole_model(ray_cluster, tiny_model):
    """With HfDeepSpeedConfig alive, from_pretrained builds the model inside deepspeed.zero.Init: when it returns,
    each of two ranks holds no parameter in full (ZeRO-2 holds all), and after DeepSpeed's set-up every parameter is
    half on each rank, the tied lm_head is still the embedding, and the weights are exactly the checkpoint's."""
    from safetensors.torch import load_file

    initial = load_file(str(Path(tiny_model) / "model.safetensors"))
    found = {}
    for zero in (2, 3):
        cfg = from_args(["--preset", "smoke", "--actor.num_workers", "2", "--actor.zero_stage", str(zero)])
        group = PolicyGroup(cfg, tiny_model)
        try:
            found[zero] = ray_cluster.get([a.__ray_call__.remote(_storage) for a in group.actors], timeout=300)
            exported = group.call_all("export_weights")[0]
        finally:
            group.shutdown()
        assert exported.keys() == initial.keys()
        assert all(torch.equal(exported[k], initial[k]) for k in initial), f"ZeRO-{zero} loaded other weights"

    total = sum(p["local"] for p in found[2][0]["params"].values())
    assert total == sum(t.numel() for t in initial.values())  # the tied lm_head counted once
    for rank in found[2]:
        assert not rank["zero3_enabled"] and rank["tied"]
        assert rank["load"]["full_param_elements"] == total
    for rank in found[3]:
        assert rank["zero3_enabled"] and rank["tied"]
        assert rank["load"]["full_param_elements"] == 0  # partitioned as built, before DeepSpeed's initialize
        for name, p in rank["params"].items():
            assert p["local"] == 0, f"{name}: the full tensor is held outside a gather"
            assert p["shard"] == -(-p["full"] // 2), f"{name}: {p['shard']} of {p['full']} elements on this rank"
    assert {n: p["full"] for n, p in found[3][0]["params"].items()} == {
        n: p["local"] for n, p in found[2][0]["params"].items()
    }


SMOKE_STEP = ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3"]


def _micro_batches(cfg, n_samples: int) -> tuple[int, int]:
    """(micro-batches per mini-batch, micro-batches in all) of one rank's train_step on n_samples."""
    per_mini = n_samples // cfg.train.mini_batches
    per_mini_micro = -(-per_mini // cfg.actor.micro_batch_size)
    return per_mini_micro, per_mini_micro * cfg.train.mini_batches


def _step_with_separate_old_pass(model_path: str, separate: bool) -> tuple[dict, dict]:
    """One kl_cov step with IS weights on; `separate` forces the no-grad old pass for every micro-batch, as a model
    with dropout gets it."""
    cfg = from_args([*SMOKE_STEP, "--async.is_correction", "on"], {"loss.type": "kl_cov"})
    cfg.loss.kl_cov.ratio = 0.1
    group = PolicyGroup(cfg, model_path)
    try:
        if separate:
            force = group.actors[0].__ray_call__.remote(lambda actor: setattr(actor, "dropout_free", False))
            ray.get(force, timeout=60)
        metrics = group.train_step(fixed_batch(), 0)
        return group.call_all("export_weights")[0], metrics
    finally:
        group.shutdown()


def test_first_mini_batch_old_log_probs_from_its_training_forward(ray_cluster, tiny_model, tmp_path):
    """The first mini-batch's old log-probs come from its training forward (the weights have not moved): the step and
    every old-log-prob metric equal the separate no-grad pass's. The two paths give the same numbers, so the count
    of micro-batches the separate pass computed is what shows which one ran. A model with dropout keeps the separate
    pass."""
    initial = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().items()}
    reused, reused_metrics = _step_with_separate_old_pass(tiny_model, separate=False)
    separate, separate_metrics = _step_with_separate_old_pass(tiny_model, separate=True)
    update = max_diff(separate, {k: initial[k] for k in separate})
    assert update > 1e-4  # the step moved the weights
    assert max_diff(reused, separate) < 1e-4 * update
    for key in ("entropy/seq_mean", "rollout/vllm_kl", "offpolicy/weight_mean", "loss/kl_cov_frac"):
        assert reused_metrics[key] == pytest.approx(separate_metrics[key], rel=1e-5, abs=1e-7), key
    first, total = _micro_batches(from_args(SMOKE_STEP), len(fixed_batch()))
    assert first < total  # more than one mini-batch: the separate pass has work either way
    assert reused_metrics["train/old_pass_micro_batches"] == total - first  # all but the first mini-batch's
    assert separate_metrics["train/old_pass_micro_batches"] == total

    # a model with attention dropout: its training forward is not the eval forward, so every micro-batch takes the
    # separate pass (packing refuses dropout in training, hence shared_prefix off)
    dropout_model = tmp_path / "dropout"
    AutoModelForCausalLM.from_pretrained(tiny_model, attention_dropout=0.1).save_pretrained(dropout_model)
    group = PolicyGroup(from_args([*SMOKE_STEP, "--train.shared_prefix", "off"]), str(dropout_model))
    try:
        assert ray.get(group.actors[0].__ray_call__.remote(lambda actor: actor.dropout_free), timeout=60) is False
        assert group.train_step(fixed_batch(), 0)["train/old_pass_micro_batches"] == total
    finally:
        group.shutdown()


def _bonus_group(tiny_model: str, coef: float, workers: int) -> PolicyGroup:
    cfg = from_args(
        ["--preset", "smoke", "--actor.num_workers", str(workers), "--actor.micro_batch_size", "2",
         "--actor.lr", "1e-3", "--async.is_correction", "off", "--loss.entropy_coef", str(coef)],
        {"loss.type": "ppo"},
    )  # fmt: skip
    return PolicyGroup(cfg, tiny_model)


def test_entropy_bonus_changes_the_update_and_logs_its_metrics(ray_cluster, tiny_model):
    """--loss.entropy_coef > 0 adds -alpha * H to the loss: the step moves the weights elsewhere than the same step
    without it, and logs the bonus (alpha times the aggregated entropy, summed over the ranks' shares: about alpha
    times the batch's token-mean entropy) and the coefficient in use. The coefficient train_step is given (the
    entropy controller's) overrides the flag; at 0 nothing is added."""
    plain_group = _bonus_group(tiny_model, 0.0, workers=1)
    try:
        plain_metrics = plain_group.train_step(fixed_batch(), 0)
        plain = plain_group.call_all("export_weights")[0]
    finally:
        plain_group.shutdown()
    assert plain_metrics["loss/entropy_bonus"] == 0.0 and plain_metrics["loss/entropy_coef"] == 0.0

    coef = 0.5
    group = _bonus_group(tiny_model, coef, workers=2)
    try:
        metrics = group.train_step(fixed_batch(), 0)
        with_bonus = group.call_all("export_weights")[0]
        override = group.train_step(fixed_batch(seed=1), 1, entropy_coef=0.0)
    finally:
        group.shutdown()
    assert metrics["loss/entropy_coef"] == coef
    assert MEASURE in metrics  # what the entropy controller reads (it refuses a step without it)
    assert metrics["loss/entropy_bonus"] == pytest.approx(coef * metrics["entropy/token_mean"], rel=0.05)
    assert max_diff(plain, with_bonus) > 1e-5
    # the policy loss itself is the same objective on the same batch and starting weights
    assert metrics["loss/policy"] == pytest.approx(plain_metrics["loss/policy"], rel=0.05, abs=1e-4)
    assert override["loss/entropy_coef"] == 0.0 and override["loss/entropy_bonus"] == 0.0
