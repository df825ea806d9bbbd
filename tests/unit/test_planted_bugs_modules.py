"""The step's helpers, each against what it promises, computed here independently: the token-budget split
(actors/micro_batches.py), LoRA's adapters and reference (actors/lora.py) and the adapter sync's files
(sync/adapter.py), the chunked head's weight gradient in bf16 (actors/chunked_head.py), the widening of half
precision logits before the temperature (actors/forward.py, chunked_head.py), and the rejection band's edges
(algorithms/off_policy.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load as safetensors_load

from entropy_openrlhf.actors.micro_batches import token_layout
from entropy_openrlhf.algorithms.off_policy import OffPolicyConfig, correct
from entropy_openrlhf.config import from_args
from tests.unit.policy_harness import Engine, load_model, model_log_probs, one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


# ------------------------------------------------------------------------------------------ the token budget


@pytest.mark.parametrize("n_ranks", [1, 2])
def test_a_prompt_group_that_exactly_fills_the_budget_stays_one_micro_batch(n_ranks):
    """Catches a prompt's responses split in two when together they hold exactly --train.max_tokens_per_micro_batch
    tokens: the budget is a most, so the group fits, and shared-prefix packing keeps its prompt once."""
    lengths = [25, 25, 25, 25, 30, 20, 30, 20]  # two prompts of four responses, 100 tokens each
    keys = [0, 0, 0, 0, 1, 1, 1, 1]
    layout = token_layout(lengths, keys, 1, n_ranks, 100, keep_groups=True)
    micro = sorted(sorted(m) for r in range(n_ranks) for m in layout.ranks[r][0] if m)
    assert micro == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # one token over the budget: the group no longer fits and is cut
    over = token_layout([26, 25, 25, 25, 30, 20, 30, 20], keys, 1, 1, 100, keep_groups=True)
    assert all(sum([26, 25, 25, 25, 30, 20, 30, 20][i] for i in m) <= 100 for m in over.ranks[0][0])
    assert sorted(map(sorted, over.ranks[0][0])) != [[0, 1, 2, 3], [4, 5, 6, 7]]


# ------------------------------------------------------------------------------------------ LoRA


def lora_config(seed: int = 3):
    return from_args(["--actor.lora_rank", "4", "--actor.lora_alpha", "8", "--train.seed", str(seed)])


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def test_adapters_start_from_the_run_s_seed_whatever_the_global_generator(tiny):
    """Catches adapters drawn from the global generator instead of --train.seed: every rank, a resumed run and a
    repeated one must start from the same adapters, whatever was drawn before, and leave the global generator as
    it was."""
    from entropy_openrlhf.actors.lora import apply_lora

    base = load_model(tiny)
    torch.manual_seed(100)
    first = adapter_tensors(apply_lora(copy.deepcopy(base), lora_config()))
    torch.manual_seed(200)
    torch.rand(7)
    state = torch.get_rng_state()
    second = adapter_tensors(apply_lora(copy.deepcopy(base), lora_config()))
    assert torch.equal(torch.get_rng_state(), state)
    assert first.keys() == second.keys() and first
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = adapter_tensors(apply_lora(copy.deepcopy(base), lora_config(seed=4)))
    assert any(not torch.equal(first[k], other[k]) for k in first if ".lora_A." in k)


def adapted(tiny: str):
    """The tiny model under LoRA, its B matrices drawn away from peft's zeros so that the adapter changes the
    output, and the base model alone."""
    from entropy_openrlhf.actors.lora import apply_lora

    base = load_model(tiny)
    model = apply_lora(copy.deepcopy(base), lora_config())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return base, model


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_the_reference_pass_is_the_base_model_in_either_mode(tiny, mode):
    """Catches an `adapter_off` that switches the adapter off in train mode only: the reference pass runs in eval
    mode, and must give the base model's log-probs at the sampling temperature (LoRA's reference), whatever mode the
    engine was left in, with the adapter back on afterwards."""
    from entropy_openrlhf.actors import train_phases
    from entropy_openrlhf.actors.lora import adapter_off

    base, model = adapted(tiny)
    cfg = from_args(["--actor.lora_rank", "4", "--rollout.temperature", "0.7", "--train.shared_prefix", "off"])
    prompts, responses = [[1, 5, 6, 7], [1, 9, 9]], [[20, 30, 40], [50, 60]]
    engine = Engine(model, cfg)
    getattr(engine, mode)()
    setup = train_phases.RankSetup(cfg, 0, 1, pad_id=0)
    got = train_phases.reference_log_probs(setup, engine, prompts, responses, [1, 1])
    want = [model_log_probs(base, p, r, temperature=0.7) for p, r in zip(prompts, responses)]
    adapted_lp = [model_log_probs(model, p, r, temperature=0.7) for p, r in zip(prompts, responses)]
    for g, w, a in zip(got, want, adapted_lp):
        assert g == pytest.approx(w, abs=1e-5)
        assert max(abs(x - y) for x, y in zip(w, a)) > 1e-3  # the adapter on: other numbers
    # the context itself, in the mode asked for
    getattr(model, mode)()
    ids = torch.tensor([[1, 5, 6, 7, 20, 30]])
    with torch.no_grad(), adapter_off(model):
        off = model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.allclose(off, base(input_ids=ids).logits, atol=1e-6)


def test_the_adapter_sync_sends_peft_s_own_keys(tiny, tmp_path):
    """Catches peft's adapter name (`.default`) left in the keys the adapter sync exports: vLLM and peft read the
    keys of `get_peft_model_state_dict`, and a file with other keys loads as an adapter of zeros (B untouched)."""
    from peft import PeftModel, get_peft_model_state_dict

    from entropy_openrlhf.sync.adapter import AdapterSender
    from entropy_openrlhf.sync.base import PolicyRank

    base, model = adapted(tiny)
    files = AdapterSender(PolicyRank(model, 0, 1, zero3=False)).export()
    sent = safetensors_load(files["adapter_model.safetensors"])
    want = get_peft_model_state_dict(model)
    assert sent.keys() == want.keys() and not any(".default" in k for k in sent)
    assert all(torch.equal(sent[k], want[k]) for k in want)
    # and peft loads the files into a fresh copy of the base as the adapted model
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    ids = torch.tensor([[1, 5, 6, 7, 20, 30]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


# ------------------------------------------------------------------------------------------ precision


def test_the_chunked_head_sums_its_weight_gradient_over_chunks_in_fp32():
    """Catches the chunked head's weight gradient summed over its chunks in bf16: 512 chunks adding gradients of
    one sign stall a bf16 sum (3% off here); summed in fp32 and rounded once, it stays within bf16 rounding of the
    fp64 gradient of the same bf16 inputs (0.15% here)."""
    from entropy_openrlhf.actors.chunked_head import HeadPost, _ChunkedHead

    g = torch.Generator().manual_seed(0)
    hidden = (torch.rand(2048, 64, generator=g) + 0.5).to(torch.bfloat16)  # positive: every chunk adds one sign
    weight = (torch.randn(128, 64, generator=g) * 0.05).to(torch.bfloat16).requires_grad_(True)
    targets = torch.full((2048,), 3, dtype=torch.long)
    lp, _ = _ChunkedHead.apply(hidden, weight, None, targets, HeadPost(), 4, False)
    lp.sum().backward()
    w64 = weight.detach().double().requires_grad_(True)
    torch.log_softmax(hidden.double() @ w64.T, -1)[:, 3].sum().backward()
    assert weight.grad.dtype == torch.bfloat16
    assert float((weight.grad.double() - w64.grad).norm() / w64.grad.norm()) < 5e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_widened_before_the_temperature(dtype):
    """Catches fp16 (or bf16) logits divided by the temperature before they are widened to fp32: vLLM's sampler
    widens first, and dividing in 16 bits rounds z / T. Both the whole head's path and the chunked head's."""
    from entropy_openrlhf.actors.chunked_head import HeadPost, _wide
    from entropy_openrlhf.actors.forward import _at_temperature

    z = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)) * 8).to(dtype)
    want = z.float() / 0.7
    assert not torch.equal(want, (z / 0.7).float())  # the other order rounds differently here
    for got in (_at_temperature(z, 0.7), HeadPost(temperature=0.7).logits(z, _wide(dtype))):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_an_fp16_model_s_log_probs_are_those_of_its_widened_logits(tiny):
    """Catches the fp16 path of forward_log_probs left in 16 bits: log-probs of an fp16 model come back in fp32,
    those of log_softmax(fp32(logits) / T)."""
    from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch

    model = load_model(tiny, torch.float16)
    prompts, responses = [[1, 5, 6, 7], [1, 9, 9]], [[20, 30, 40], [50, 60]]
    batch = make_seq_batch(prompts, responses, 0)
    with torch.no_grad():
        lp, _ = forward_log_probs(model, batch, temperature=0.7)
    assert lp.dtype == torch.float32
    want = [x for p, r in zip(prompts, responses) for x in model_log_probs(model, p, r, temperature=0.7)]
    assert lp[batch.mask.bool()].tolist() == pytest.approx(want, abs=1e-5)


# ------------------------------------------------------------------------------------------ the rejection band


@pytest.mark.parametrize("reject", ["token", "sequence_geo", "sequence"])
def test_a_ratio_on_the_band_s_edges_is_kept(reject):
    """Catches an exclusive edge of the rejection band: at --offpolicy.reject_min 1 (and reject_max 1) every
    on-policy token, ratio exactly 1, would be dropped. The band is closed: [reject_min, reject_max]."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, -0.1, 0.0, 0.0]])
    for low, high in ((1.0, 1.0), (1.0, 2.0), (0.5, 1.0)):
        out = correct(lp, lp.clone(), mask, OffPolicyConfig(reject=reject, reject_min=low, reject_max=high))
        assert torch.equal(out.keep, mask.bool()), (low, high)
        assert torch.equal(out.weights, mask) and out.metrics["offpolicy/rejected_frac"] == 0.0
    # just outside the band: rejected (so the band does reject)
    shifted = lp + torch.tensor([[0.01], [0.0]])  # response 0 at a ratio of e^0.01 per token
    out = correct(shifted, lp, mask, OffPolicyConfig(reject=reject, reject_min=1.0, reject_max=1.0))
    assert not out.keep[0].any() and torch.equal(out.keep[1], mask[1].bool())
