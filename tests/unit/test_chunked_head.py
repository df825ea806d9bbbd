"""`--train.head_chunk_tokens` (forward.py `use_chunked_head`): the vocabulary projection, log-probs and entropies
computed a chunk of response tokens at a time must give what the whole-grid forward gives, for every family it
accepts (with Granite's logit scaling and Gemma's soft-capping set where they change the numbers), in the plain and
the packed layout, at T != 1, through a peft wrapper, and with the gradients of a loss that uses both log-probs and
the entropy bonus. In fp64, so that a difference is a bug and not rounding; and no call of the head ever sees more
rows than a chunk, apart from the one last position the model's own forward is asked for."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from entropy_openrlhf.actors import chunked_head
from entropy_openrlhf.actors.chunked_head import CHUNKED_HEAD_FAMILIES, HEAD_CHUNK_ATTR, use_chunked_head
from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch, use_shared_prefix

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
            vocab_size=128)  # fmt: skip
# what makes a family's head differ from a plain projection, set so that it changes the numbers here
EXTRA = {
    "qwen3": {"head_dim": 64},
    "gemma2": {"head_dim": 64, "final_logit_softcapping": 0.5},
    "gemma3_text": {"head_dim": 64, "final_logit_softcapping": 0.5},
    "phi3": {"pad_token_id": 0},
    "granite": {"logits_scaling": 3.0},
}
# two groups sharing a prompt (packed: one row each) and a lone prompt; responses of different lengths (padding)
PROMPTS = [[1, 5, 6, 7, 8]] * 3 + [[1, 9, 9]] + [[1, 4, 4, 4]] * 2
RESPONSES = [[20, 30, 40], [50, 60], [70, 80, 90, 100, 101, 102], [21], [5, 6, 7], [11, 12]]
CHUNK = 4  # 17 response tokens: 5 chunks, the last of one


def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**TINY, **EXTRA.get(family, {})})
    model = AutoModelForCausalLM.from_config(config).double()
    # larger weights than the init's: logits of several units, where soft-capping at 0.5 is far from the identity
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def loss_and_grads(model, batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs and entropies on the response tokens, and every parameter's gradient of a loss that uses both (a
    policy-gradient term with mixed-sign advantages and the entropy bonus)."""
    model.zero_grad()
    lp, ent = forward_log_probs(model, batch, temperature=temperature, entropy_grad=True)
    valid = batch.mask.bool()
    advantages = torch.linspace(-1.0, 1.0, int(valid.sum()), dtype=torch.float64)
    loss = -(lp[valid] * advantages).sum() - 0.1 * ent[valid].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp[valid].detach(), ent[valid].detach(), grads


def assert_same(whole, chunked) -> None:
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-10, atol=1e-12)
    assert chunked[2].keys() == whole[2].keys() and whole[2]
    for name in whole[2]:
        torch.testing.assert_close(chunked[2][name], whole[2][name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("family", CHUNKED_HEAD_FAMILIES)
def test_every_accepted_family_gives_the_whole_forward_s_log_probs_entropies_and_gradients(family):
    model = tiny(family)
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    whole = loss_and_grads(model, batch, 1.0)
    assert use_chunked_head(model, CHUNK)
    assert_same(whole, loss_and_grads(model, batch, 1.0))


def test_the_head_s_post_processing_is_what_makes_those_families_agree():
    """Without Gemma's soft-capping the chunked log-probs would differ: the test above can tell."""
    model = tiny("gemma2")
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    whole = loss_and_grads(model, batch, 1.0)
    model.config.final_logit_softcapping = None
    use_chunked_head(model, CHUNK)
    assert float((loss_and_grads(model, batch, 1.0)[0] - whole[0]).abs().max()) > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_packed_layout_and_a_temperature(temperature):
    model = tiny("llama")
    assert use_shared_prefix(model, "on")
    batch = make_seq_batch(PROMPTS, RESPONSES, 0, shared_prefix="on", model_config=model.config)
    assert batch.packed is not None and len(batch.packed.rows) == 3
    whole = loss_and_grads(model, batch, temperature)
    use_chunked_head(model, CHUNK)
    assert_same(whole, loss_and_grads(model, batch, temperature))


def test_the_setting_reaches_the_forward_through_a_peft_wrapper():
    from peft import LoraConfig, get_peft_model  # the LoRA extra, as in actors/lora.py

    model = tiny("llama")
    use_chunked_head(model, CHUNK)  # before peft wraps it, as build_policy_engine does
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert getattr(wrapped, HEAD_CHUNK_ATTR) == CHUNK
    for name, p in wrapped.named_parameters():  # non-zero adapters, so that they change the numbers
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    chunked = loss_and_grads(wrapped, batch, 1.0)
    assert not use_chunked_head(model, 0)  # off again, on the model inside the wrapper
    assert_same(loss_and_grads(wrapped, batch, 1.0), chunked)


def test_in_bf16_the_chunked_head_stays_within_rounding_of_the_whole_one():
    """The working precision of a GPU run: the log-probs come back in fp32 as the whole head's do, and log-probs,
    entropies and gradients differ only by bf16 rounding (the chunks' products are other matrix shapes; 1.8% at most
    on one CPU for the gradients, 1e-6 for the log-probs)."""
    model = tiny("qwen2").to(torch.bfloat16)
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    whole = loss_and_grads(model, batch, 0.7)
    use_chunked_head(model, CHUNK)
    chunked = loss_and_grads(model, batch, 0.7)
    assert chunked[0].dtype == whole[0].dtype == torch.float32
    assert float((chunked[0] - whole[0]).abs().max()) < 0.05
    assert float((chunked[1] - whole[1]).abs().max()) < 0.05
    for name, g in whole[2].items():
        assert chunked[2][name].dtype == g.dtype
        assert float((chunked[2][name].float() - g.float()).norm()) <= 0.05 * float(g.float().norm()) + 1e-6, name


def test_no_logits_of_more_than_a_chunk_and_one_head_call_whatever_the_tokens(monkeypatch):
    """Each projection in the Function covers at most a chunk of rows, in the forward and again in the backward; the
    head module is called once more than the model's own forward calls it, for a full batch as for a stand-in with no
    response token (under ZeRO-3 each call gathers the weight: a collective every rank must make as often)."""
    rows_projected: list[int] = []

    def linear(x, weight, bias=None):
        rows_projected.append(x.shape[0])
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(chunked_head, "F", types.SimpleNamespace(linear=linear))
    model = tiny("llama")
    use_chunked_head(model, CHUNK)
    head_calls: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_calls.append(1))
    loss_and_grads(model, make_seq_batch(PROMPTS, RESPONSES, 0), 1.0)
    assert rows_projected == [4, 4, 4, 4, 1] * 2  # 17 response tokens, forward then backward
    assert len(head_calls) == 2  # the model's own forward (its last position), then the chunked head
    with torch.no_grad():  # the no-grad pass (old log-probs, reference): each chunk once
        rows_projected.clear()
        forward_log_probs(model, make_seq_batch(PROMPTS, RESPONSES, 0), with_entropy=True)
    assert rows_projected == [4, 4, 4, 4, 1]

    # a stand-in (one pad token of response, masked out): the same two head calls and a backward through the model
    head_calls.clear()
    stand_in = make_seq_batch([[0]], [[0]], 0)
    stand_in.mask.zero_()
    lp, _ = forward_log_probs(model, stand_in)
    (lp.sum() * 0.0).backward()
    assert len(head_calls) == 2
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_a_family_whose_head_is_not_known_and_a_negative_chunk_are_refused():
    config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=1, vocab_size=128)
    with pytest.raises(ValueError, match=r"--train.head_chunk_tokens 8: model type 'gpt2' .*head_chunk_tokens 0"):
        use_chunked_head(AutoModelForCausalLM.from_config(config), 8)
    with pytest.raises(ValueError, match="must be >= 0"):
        use_chunked_head(tiny("llama"), -1)
    assert not use_chunked_head(tiny("llama"), 0)
