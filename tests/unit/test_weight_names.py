"""The start-up check that every weight the policy exports is one the rollout engine can load (weight_names.py), on
tiny random models of each family saved by transformers as a user's checkpoint would be. docs/guides/cluster.md lists
these
families; a family added there is added here."""

import os

import pytest

from entropy_openrlhf.actors.weight_names import (
    UnloadableWeightError,
    check_weight_names,
    checkpoint_weight_names,
    exported_weight_names,
    first_unloadable,
)

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
            vocab_size=128)  # fmt: skip
# family -> extra config: the dense families keep the checkpoint's names in their modules
DENSE = {
    "llama": {},  # SmolLM2, the tiny test model
    "qwen2": {},  # Qwen2.5, the paper's models
    "qwen3": {"head_dim": 64},
    "mistral": {},
    "gemma2": {"head_dim": 64},
    "gemma3_text": {"head_dim": 64},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "granite": {},
}
# MoE families whose transformers 5 modules fuse the experts' checkpoint tensors: refused, naming the first weight
FUSED = {
    "mixtral": ({"num_local_experts": 2, "num_experts_per_tok": 1}, "model.layers.0.mlp.gate.weight"),
    "qwen2_moe": (
        {
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        "model.layers.0.mlp.experts.gate_up_proj",
    ),
    "qwen3_moe": (
        {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32, "head_dim": 64},
        "model.layers.0.mlp.experts.gate_up_proj",
    ),
    "deepseek_v3": (
        {
            "first_k_dense_replace": 0,
            "n_routed_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },  # fmt: skip
        "model.layers.0.mlp.experts.gate_up_proj",
    ),
}


def save_tiny(family: str, extra: dict, folder) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**TINY, **extra})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def test_the_first_name_outside_the_accepted_set_is_the_one_named():
    assert first_unloadable(["a", "b", "c"], {"a", "b", "c", "extra"}) is None
    assert first_unloadable(["a", "x", "y"], {"a"}) == "x"


@pytest.mark.parametrize("family", list(DENSE))
def test_dense_families_export_the_checkpoint_s_names(family, tmp_path):
    folder = save_tiny(family, DENSE[family], tmp_path)
    assert check_weight_names(folder) == len(exported_weight_names(folder)) > 0


@pytest.mark.parametrize("family", list(FUSED))
def test_families_with_fused_expert_modules_are_refused_in_one_line_naming_the_first_weight(family, tmp_path):
    extra, first = FUSED[family]
    folder = save_tiny(family, extra, tmp_path)
    with pytest.raises(UnloadableWeightError) as e:
        check_weight_names(folder)
    msg = str(e.value)
    assert msg.startswith(f"the policy would send weight {first!r}, which the rollout engine cannot load")
    assert folder in msg and "docs/guides/cluster.md" in msg and "\n" not in msg


def test_the_export_s_names_are_the_policy_model_s_named_parameters(tmp_path):
    """The check's names are what PolicyActor.export_weights sends: named_parameters of the loaded model, a tied
    head once (under the embedding's name)."""
    from transformers import AutoModelForCausalLM

    from entropy_openrlhf.models.tiny import make_tiny_model

    folder = str(make_tiny_model(tmp_path / "tiny"))
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert exported_weight_names(folder) == [n for n, _ in loaded.named_parameters()]
    assert "lm_head.weight" not in exported_weight_names(folder)  # tied, and absent from the checkpoint too
    assert check_weight_names(folder) > 0


def test_a_sharded_checkpoint_is_read_from_its_index(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **TINY))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    assert checkpoint_weight_names(str(tmp_path)) == set(model.state_dict())
    assert check_weight_names(str(tmp_path)) > 0


def test_a_checkpoint_without_safetensors_is_not_checked(tmp_path):
    assert checkpoint_weight_names(str(tmp_path)) is None
    assert check_weight_names(str(tmp_path)) == 0


def test_an_engine_refuses_such_a_model_before_vllm_starts(tmp_path, monkeypatch):
    """RolloutEngine's constructor runs the check first: a MoE model fails in one line, without vLLM loading it."""
    from entropy_openrlhf.actors.rollout import RolloutEngine
    from entropy_openrlhf.cluster import CPU_DEFAULT_ENV

    extra, first = FUSED["qwen3_moe"]
    folder = save_tiny("qwen3_moe", extra, tmp_path)
    for key, value in CPU_DEFAULT_ENV.items():  # what set_cpu_defaults would set, undone after the test
        monkeypatch.setenv(key, os.environ.get(key, value))
    with pytest.raises(UnloadableWeightError, match=f"^the policy would send weight '{first}'"):
        RolloutEngine(folder)
