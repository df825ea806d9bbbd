"""The DeepSpeed policy group on a fixed batch: real Ray actors, gloo, ZeRO: data-parallel ranks against one, ZeRO-3's
shards, a skipped non-finite step, the rendezvous. What the step's own code decides (objectives against PPO, the first
mini-batch's old log-probs, the entropy bonus, a global selection) runs on the same batches in the unit tier, behind
tests/unit/policy_harness.py's stand-in for DeepSpeed: tests/unit/test_policy_step_logic.py."""

import random
from pathlib import Path

import pytest
import ray
import torch

from entropy_openrlhf.actors.policy import PolicyGroup, TrainSample
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


def policy_config(loss: str, workers: int = 1, scope: str = "micro_batch", zero: int = 2):
    cfg = from_args(
        [
            "--preset", "smoke",
            "--actor.num_workers", str(workers),
            "--actor.zero_stage", str(zero),
            "--actor.micro_batch_size", "2",
            "--loss.scope", scope,
            "--actor.lr", "1e-3",
            "--offpolicy.preset", "none",
        ],
        {"loss.type": loss, **({"loss.clip_low": 1.0, "loss.clip_high": 1.0} if loss == "clip_cov" else {})},
    )  # fmt: skip
    cfg.loss.kl_cov.ratio = 0.1
    cfg.loss.clip_cov.ratio = 0.1
    cfg.loss.clip_cov.lb, cfg.loss.clip_cov.ub = -1e9, 1e9  # tiny random models have tiny covariances
    return cfg


def train_once(model_path: str, loss: str, workers: int = 1, steps: int = 1, scope: str = "micro_batch", zero=2):
    group = PolicyGroup(policy_config(loss, workers, scope, zero), model_path)
    try:
        metrics = [group.train_step(fixed_batch(), step) for step in range(steps)]
        return group.call_all("export_weights")[0], metrics
    finally:
        group.shutdown()


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("scope", ["micro_batch", "global"])
def test_two_data_parallel_ranks_match_one(ray_cluster, tiny_model, scope):
    """The global normaliser makes sharding invisible: 2 ranks x half the batch == 1 rank x the whole batch.
    (PPO: its update does not depend on the selection scope, so the two runs must agree to float precision.)"""
    one, m1 = train_once(tiny_model, "ppo", workers=1, scope=scope)
    two, m2 = train_once(tiny_model, "ppo", workers=2, scope=scope)
    assert m1[0]["loss/policy"] == pytest.approx(m2[0]["loss/policy"], rel=1e-4, abs=1e-6)
    assert max_diff(one, two) < 1e-5


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


def test_zero3_loads_its_shards_then_trains_and_exports_like_zero2(ray_cluster, tiny_model):
    """The GPU presets use ZeRO-3: parameters sharded over the ranks, gathered one at a time for the HF export.

    Loading: with HfDeepSpeedConfig alive, from_pretrained builds the model inside deepspeed.zero.Init: when it
    returns, each of two ranks holds no parameter in full (ZeRO-2 holds all), and after DeepSpeed's set-up every
    parameter is half on each rank, the tied lm_head is still the embedding, and the weights are exactly the
    checkpoint's. Training: two steps on two ranks must then give ZeRO-2's weights, under the HF names, with full
    (unsharded) shapes. One group per stage serves both."""
    from safetensors.torch import load_file

    initial = load_file(str(Path(tiny_model) / "model.safetensors"))
    found, trained, metrics = {}, {}, {}
    for zero in (2, 3):
        group = PolicyGroup(policy_config("kl_cov", workers=2, zero=zero), tiny_model)
        try:
            found[zero] = ray_cluster.get([a.__ray_call__.remote(_storage) for a in group.actors], timeout=300)
            exported = group.call_all("export_weights")[0]
            metrics[zero] = [group.train_step(fixed_batch(), step) for step in range(2)]
            trained[zero] = group.call_all("export_weights")[0]
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

    zero2, zero3 = trained[2], trained[3]
    assert zero3.keys() == zero2.keys()
    assert all(zero3[k].shape == zero2[k].shape for k in zero2)
    assert metrics[3][1]["loss/policy"] == pytest.approx(metrics[2][1]["loss/policy"], rel=1e-4, abs=1e-6)
    assert max_diff(zero2, zero3) < 1e-5
    assert max_diff(initial, zero3) > 1e-6  # it trained
