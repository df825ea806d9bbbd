"""forward_log_probs projects only the response positions onto the vocabulary; it must give what the full
logits give, values and gradients, on every response token."""

from __future__ import annotations

import pytest
import torch

from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from entropy_openrlhf.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def full_reference(model, batch):
    """Independent computation: every position's logits, log_softmax, gather; entropy -sum p log p."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent.detach()


@pytest.mark.parametrize(
    "prompt_lens, response_lens",
    [([7, 12, 9], [5, 1, 8]), ([4, 4], [0, 6]), ([3], [0])],  # unequal prompts; an empty response; nothing at all
)
def test_matches_full_logits_values_and_gradients(model, prompt_lens, response_lens):
    g = torch.Generator().manual_seed(sum(prompt_lens) + sum(response_lens))
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in response_lens]
    batch = make_seq_batch(prompts, responses, pad_id=0)
    mask = batch.mask.bool()

    lp, ent = forward_log_probs(model, batch, with_entropy=True)
    ref_lp, ref_ent = full_reference(model, batch)
    assert lp.shape == ent.shape == batch.mask.shape
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[mask], ref_ent[mask], rtol=1e-4, atol=1e-5)
    if not mask.any():
        return

    weights = torch.randn(batch.mask.shape, generator=g) * batch.mask
    model.zero_grad()
    (lp * weights).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (ref_lp * weights).sum().backward()
    for got, want in zip(ours, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
