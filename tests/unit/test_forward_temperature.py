"""forward_log_probs at a sampling temperature T != 1 (`--rollout.temperature`): the log-probs and entropies are
those of softmax(logits / T), in the plain and the shared-prefix packed layout, against log_softmax(logits / T)
computed here from every position's full logits, and they differ from the T = 1 values by far more than the
tolerance (so a forgotten division would fail)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch, use_shared_prefix
from entropy_openrlhf.models.tiny import make_tiny_model

# two groups sharing a prompt (packed: one row each) and a lone prompt; one response of a single token
PROMPTS = [[1, 5, 6, 7, 8]] * 3 + [[1, 9, 9]] + [[1, 4, 4, 4]] * 2
RESPONSES = [[20, 30, 40], [50, 60], [70, 80, 90, 100], [21], [5, 6, 7], [11, 12]]
T = 0.7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def independent(model, prompts, responses, temperature):
    """One sequence at a time, every position's logits: log_softmax(logits / T) of each response token, and the
    entropy -sum p log p of that whole distribution. Returned as flat lists in the grid's row-major order."""
    lps, ents = [], []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].double()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            lps += logp.gather(-1, torch.tensor(r)[:, None])[:, 0].tolist()
            ents += (-(logp.exp() * logp).sum(-1)).tolist()
    return torch.tensor(lps, dtype=torch.float64), torch.tensor(ents, dtype=torch.float64)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_log_probs_and_entropy_are_those_of_logits_over_t(tiny, layout):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()  # never switched to packing
    shared = "on" if layout == "packed" else "off"
    if layout == "packed":
        assert use_shared_prefix(model, "on")
    batch = make_seq_batch(PROMPTS, RESPONSES, 0, shared_prefix=shared, model_config=model.config)
    if layout == "packed":
        assert len(batch.packed.rows) == 3  # the prompts are shared: the packed path runs
    valid = batch.mask.bool()
    with torch.no_grad():
        lp, ent = forward_log_probs(model, batch, temperature=T, with_entropy=True)
        lp1, ent1 = forward_log_probs(model, batch, with_entropy=True)
    want_lp, want_ent = independent(plain, PROMPTS, RESPONSES, T)
    want_lp1, _ = independent(plain, PROMPTS, RESPONSES, 1.0)
    torch.testing.assert_close(lp[valid].double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[valid].double(), want_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp1[valid].double(), want_lp1, rtol=1e-5, atol=1e-5)
    # T = 0.7 is a different distribution: far more apart than the tolerance above
    assert float((lp[valid] - lp1[valid]).abs().max()) > 1e-2
    assert float((ent[valid] - ent1[valid]).abs().max()) > 1e-2


def test_the_gradient_is_that_of_logits_over_t(tiny):
    """The training forward differentiates the tempered log-probs: d/dtheta of sum(w * lp_T) equals the independent
    one."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    valid = batch.mask.bool()
    w = torch.linspace(-1.0, 1.0, int(valid.sum()), dtype=torch.float64)
    lp, _ = forward_log_probs(model, batch, temperature=T)
    (lp[valid] * w).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lps = []
    for p, r in zip(PROMPTS, RESPONSES):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        lps.append(torch.log_softmax(logits / T, dim=-1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    (torch.cat(lps) * w).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-6, atol=1e-9)
    assert any(float(g.abs().max()) > 0 for g in ours.values())


def test_in_bf16_the_logits_are_widened_before_the_division_as_vllm_samples(tiny):
    """vLLM's sampler turns the logits to fp32, then divides by T. Dividing bf16 logits first rounds z / T to 8 bits
    of mantissa: here that moves the log-probs by about 1e-4, ten times the tolerance; widened first, they agree
    with the fp64 reference to fp32 rounding. (The plain layout: the packed one's bf16 attention rounds differently
    from the reference's, and shares the widening, `_at_temperature`.)"""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).eval()
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    valid = batch.mask.bool()
    with torch.no_grad():
        lp, ent = forward_log_probs(model, batch, temperature=T, with_entropy=True)
    want_lp, want_ent = independent(plain, PROMPTS, RESPONSES, T)  # the bf16 logits in fp64, then / T
    torch.testing.assert_close(lp[valid].double(), want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[valid].double(), want_ent, rtol=0, atol=1e-5)
    # the same logits divided in bf16 first: what the tolerance above tells apart
    rounded = []
    with torch.no_grad():
        for p, r in zip(PROMPTS, RESPONSES):
            logits = plain(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            logp = torch.log_softmax((logits / T).double(), dim=-1)
            rounded += logp.gather(-1, torch.tensor(r)[:, None])[:, 0].tolist()
    assert float((torch.tensor(rounded, dtype=torch.float64) - want_lp).abs().max()) > 1e-4


def test_the_chunked_head_widens_before_it_divides_too():
    from entropy_openrlhf.actors.chunked_head import HeadPost

    z = torch.randn(4, 1000, dtype=torch.bfloat16) * 8
    got = HeadPost(temperature=T).logits(z, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, z.float() / T)
    assert not torch.equal(got, (z / T).float())  # the other order rounds differently
