"""LoRA's views of the adapted policy (actors/lora.py): the merged weights under the base model's names against
peft's own merge_and_unload and against W + alpha/r B A written out here, the reference as the base with the
adapter off, and which parameters train."""

import contextlib
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.lora import adapter_off, apply_lora, base_name, named_weights
from entropy_openrlhf.config import from_args
from entropy_openrlhf.models.tiny import make_tiny_model

RANK, ALPHA = 4, 8.0


def no_gather(params):
    return contextlib.nullcontext()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def adapted(tiny: str, targets: str = "all-linear"):
    cfg = from_args(["--actor.lora_rank", str(RANK), "--actor.lora_alpha", str(ALPHA),
                     "--actor.lora_target_modules", targets])  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model = apply_lora(copy.deepcopy(base), cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (no change): give the adapters an update to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return base, model


def test_only_the_adapters_train_and_all_linear_leaves_the_lm_head_and_embedding(tiny):
    base, model = adapted(tiny)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapted_modules = {n.split(".lora_")[0] for n in trainable}
    suffixes = {m.rsplit(".", 1)[-1] for m in adapted_modules}
    assert suffixes == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # named modules
    _, some = adapted(tiny, "q_proj, v_proj")
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in some.named_parameters() if p.requires_grad} == {
        "q_proj", "v_proj"}  # fmt: skip


def test_named_weights_are_the_base_names_with_each_adapters_update(tiny):
    base, model = adapted(tiny)
    merged = {name: t.clone() for name, t in named_weights(model, no_gather)}
    assert list(merged) == [n for n, _ in base.named_parameters()]
    # W + alpha / r * B A, written out from the adapter's own matrices
    params = dict(model.named_parameters())
    for name, w in base.named_parameters():
        prefix = "base_model.model." + name.removesuffix(".weight")
        a = params.get(f"{prefix}.lora_A.default.weight")
        want = w.detach() if a is None else w.detach() + ALPHA / RANK * params[f"{prefix}.lora_B.default.weight"] @ a
        assert torch.allclose(merged[name], want, atol=1e-6), name
    assert any(not torch.equal(merged[n], w) for n, w in base.named_parameters())  # the adapters moved something
    # and peft's own merge agrees; the training weights are untouched
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[n], peft_merged[n], atol=1e-6) for n in merged)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_reference_is_the_base_with_the_adapter_off(tiny):
    base, model = adapted(tiny)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = base(input_ids=ids).logits
        with adapter_off(model):
            off = model(input_ids=ids).logits
        on = model(input_ids=ids).logits
    assert torch.allclose(off, want, atol=1e-6)
    assert (on - want).abs().max() > 1e-4  # the adapter changes the output once back on
    assert adapter_off(base) is not None  # no adapter: a no-op context
    with adapter_off(base):
        assert torch.allclose(base(input_ids=ids).logits, want)


def test_without_lora_the_weights_are_the_parameters(tiny):
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    got = [(n, t) for n, t in named_weights(base, no_gather)]
    assert [(n, t.data_ptr()) for n, t in got] == [(n, p.data_ptr()) for n, p in base.named_parameters()]


def test_names():
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert base_name("base_model.model.model.norm.weight") == "model.norm.weight"
