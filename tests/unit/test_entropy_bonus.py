"""The entropy bonus (`--loss.entropy_coef`): its entropy and gradient against a hand computation in fp64, its
aggregation (the policy loss's: split micro-batches and ranks with a global normaliser change nothing), and the
entropy with gradient through the plain and the shared-prefix packed forward.

The hand computation uses Python floats only: p = exp(z - max) / sum, H = -sum p log p, and the gradient of H with
respect to the logits, dH/dz_j = -p_j (log p_j + H), derived on paper (d log p_i / dz_j = [i = j] - p_j).
"""

from __future__ import annotations

import math

import pytest
import torch

from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch, use_shared_prefix
from entropy_openrlhf.algorithms.losses import entropy_bonus
from entropy_openrlhf.algorithms.metrics import token_entropy, token_entropy_with_grad


def hand_entropy_and_grad(row: list[float]) -> tuple[float, list[float]]:
    top = max(row)
    e = [math.exp(v - top) for v in row]
    total = sum(e)
    p = [x / total for x in e]
    h = -sum(pi * math.log(pi) for pi in p)
    return h, [-pi * (math.log(pi) + h) for pi in p]


def random_logits(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a wide spread so some rows are peaked and some flat
    return (torch.randn(shape, generator=g, dtype=torch.float64) * torch.linspace(0.1, 6.0, shape[-2])[:, None]).to(
        dtype
    )


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_entropy_and_gradient_equal_the_hand_computation_fp64(chunk_size):
    z = random_logits((2, 5, 13), seed=chunk_size).requires_grad_(True)
    weights = torch.randn(2, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h = token_entropy_with_grad(z, chunk_size=chunk_size)
    assert h.dtype == torch.float64 and h.shape == (2, 5)
    (h * weights).sum().backward()
    for b in range(2):
        for t in range(5):
            want_h, want_grad = hand_entropy_and_grad(z[b, t].tolist())
            assert h[b, t].item() == pytest.approx(want_h, rel=1e-12, abs=1e-13)
            got = z.grad[b, t].tolist()
            w = weights[b, t].item()
            assert got == pytest.approx([w * g for g in want_grad], rel=1e-10, abs=1e-13)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("normalizer, dp_size", [(None, 1), (40.0, 1), (7.0, 2)])
def test_bonus_value_and_gradient_equal_the_hand_computation_fp64(agg, normalizer, dp_size):
    """-coef * H aggregated as the policy loss: token_mean weighs each valid token dp/N, seq_mean_token_mean weighs a
    token of response i dp/(S * len_i), N and S the normaliser or the call's own count."""
    B, L, V, coef = 3, 6, 9, 0.37
    z = random_logits((B, L, V), seed=11).requires_grad_(True)
    lengths = [6, 2, 0]  # a full response, a short one, an empty one
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(L)] for n in lengths], dtype=torch.float64)
    loss = entropy_bonus(token_entropy_with_grad(z), mask, coef, agg, normalizer, dp_size)
    loss.backward()

    scale = 1.0 if normalizer is None else float(dp_size)
    if agg == "token_mean":
        count = normalizer if normalizer is not None else sum(lengths)
        weight = [[scale / count] * L for _ in lengths]
    else:
        count = normalizer if normalizer is not None else sum(n > 0 for n in lengths)
        weight = [[scale / (count * n) if n else 0.0] * L for n in lengths]
    want_loss = 0.0
    for b, n in enumerate(lengths):
        for t in range(L):
            h, grad = hand_entropy_and_grad(z[b, t].tolist())
            w = weight[b][t] if t < n else 0.0
            want_loss += -coef * w * h
            assert z.grad[b, t].tolist() == pytest.approx([-coef * w * g for g in grad], rel=1e-10, abs=1e-14)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert loss.item() < 0  # a bonus: more entropy, lower loss


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_split_micro_batches_and_ranks_give_the_whole_batch_bonus(agg):
    """Each micro-batch returns its share of the mini-batch mean: summed over micro-batches (and over ranks, whose
    gradients DeepSpeed averages, undone by dp_size) value and gradient equal the whole batch's."""
    B, L, V, coef = 6, 7, 10, 0.05
    base = random_logits((B, L, V), seed=3)
    lengths = [7, 1, 4, 0, 6, 3]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(L)] for n in lengths], dtype=torch.float64)
    tokens, sequences = float(sum(lengths)), float(sum(n > 0 for n in lengths))
    norm = tokens if agg == "token_mean" else sequences

    whole_z = base.clone().requires_grad_(True)
    whole = entropy_bonus(token_entropy_with_grad(whole_z), mask, coef, agg)
    whole.backward()

    # one rank, three micro-batches of 2 rows, the mini-batch's normaliser
    split_z = base.clone().requires_grad_(True)
    total = sum(
        entropy_bonus(token_entropy_with_grad(split_z[r : r + 2]), mask[r : r + 2], coef, agg, norm, 1)
        for r in range(0, B, 2)
    )
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(split_z.grad, whole_z.grad, rtol=1e-12, atol=1e-15)

    # two ranks of three rows each, one micro-batch per rank, dp_size 2; DeepSpeed averages the gradients
    rank_z = [base[:3].clone().requires_grad_(True), base[3:].clone().requires_grad_(True)]
    shares = [
        entropy_bonus(token_entropy_with_grad(zr), m, coef, agg, norm, 2)
        for zr, m in zip(rank_z, (mask[:3], mask[3:]), strict=True)
    ]
    for s in shares:
        s.backward()
    assert sum(s.item() for s in shares) / 2 == pytest.approx(whole.item(), rel=1e-12)
    # each rank's gradient is zero on the other's rows; DeepSpeed's average halves the sum
    averaged = torch.cat([rank_z[0].grad, rank_z[1].grad]) / 2
    torch.testing.assert_close(averaged, whole_z.grad, rtol=1e-12, atol=1e-15)


def test_values_equal_the_telemetry_entropy_and_half_precision_keeps_its_dtype():
    z32 = random_logits((4, 9, 50), seed=5, dtype=torch.float32)
    torch.testing.assert_close(token_entropy_with_grad(z32), token_entropy(z32), rtol=0, atol=0)
    zb = z32.to(torch.bfloat16).requires_grad_(True)
    h = token_entropy_with_grad(zb, chunk_size=4)
    assert h.dtype == torch.float32  # fp32 math whatever the input
    torch.testing.assert_close(h, token_entropy(zb), rtol=0, atol=0)
    h.sum().backward()
    assert zb.grad.dtype == torch.bfloat16
    z = zb.detach().float().requires_grad_(True)
    token_entropy_with_grad(z).sum().backward()
    torch.testing.assert_close(zb.grad.float(), z.grad, rtol=2e-2, atol=2e-3)


def test_a_gradient_step_on_the_bonus_raises_the_entropy():
    z = random_logits((3, 4, 20), seed=9, dtype=torch.float32).requires_grad_(True)
    mask = torch.ones(3, 4)
    before = token_entropy(z)
    entropy_bonus(token_entropy_with_grad(z), mask, 1.0).backward()
    with torch.no_grad():
        after = token_entropy(z - 0.5 * z.grad)
    assert (after > before).all()


def test_padding_entropy_never_reaches_the_loss_or_the_gradient():
    z = random_logits((2, 3, 5), seed=2)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    z[0, 2, 0], z[1, 1, 1], z[1, 2] = math.inf, math.nan, -math.inf  # garbage logits on padding: entropy NaN there
    z.requires_grad_(True)
    h = token_entropy_with_grad(z)
    assert not torch.isfinite(h[~mask.bool()]).any()
    loss = entropy_bonus(h, mask, 0.1)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(z.grad).all()
    assert (z.grad[~mask.bool()] == 0).all()


@pytest.mark.parametrize("coef", [-0.1, math.nan, math.inf])
def test_a_negative_or_non_finite_coefficient_is_refused(coef):
    with pytest.raises(ValueError, match="coefficient"):
        entropy_bonus(torch.zeros(1, 2), torch.ones(1, 2), coef)


# --------------------------------------------------------------------------- through the model's forward

PROMPTS = [[1, 5, 6, 7, 8]] * 3 + [[1, 9, 9]] + [[1, 4, 4, 4]] * 2
RESPONSES = [[20, 30, 40], [50, 60], [70, 80, 90, 100, 110], [5, 6, 7, 8], [11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def parameter_grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def test_entropy_gradient_through_the_plain_and_packed_forward_equals_autograd_of_the_full_logits(tiny):
    """The bonus's parameter gradient: the plain forward (logits from the first response position on), the packed
    one (each prompt once per group) and an independent reference (every position's logits, -sum p log p by
    autograd) agree in fp64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
    plain = make_seq_batch(PROMPTS, RESPONSES, 0)
    coef = 0.3

    logits = model(input_ids=plain.input_ids, attention_mask=plain.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits, dim=-1)
    reference_h = -(logp.exp() * logp).sum(-1)
    entropy_bonus(reference_h, plain.mask, coef).backward()
    want = parameter_grads(model)

    lp, h = forward_log_probs(model, plain, entropy_grad=True)
    assert h.requires_grad and h.dtype == lp.dtype
    torch.testing.assert_close(h * plain.mask, reference_h.detach() * plain.mask, rtol=1e-10, atol=1e-12)
    entropy_bonus(h, plain.mask, coef).backward()
    got_plain = parameter_grads(model)

    assert use_shared_prefix(model, "on")
    packed = make_seq_batch(PROMPTS, RESPONSES, 0, shared_prefix="on", model_config=model.config)
    assert len(packed.packed.rows) == 3
    _, hp = forward_log_probs(model, packed, entropy_grad=True)
    torch.testing.assert_close(hp * packed.mask, reference_h.detach() * plain.mask, rtol=1e-10, atol=1e-12)
    entropy_bonus(hp, packed.mask, coef).backward()
    got_packed = parameter_grads(model)

    assert want.keys() == got_plain.keys() == got_packed.keys()
    assert any(float(g.abs().max()) > 0 for g in want.values())
    for name, g in want.items():
        scale = float(g.abs().max()) or 1.0
        assert float((got_plain[name] - g).abs().max()) <= 1e-9 * scale, name
        assert float((got_packed[name] - g).abs().max()) <= 1e-6 * scale, name  # fp32 RMSNorm, summation order


def test_forward_entropy_is_detached_unless_asked(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = make_seq_batch(PROMPTS, RESPONSES, 0)
    lp, h = forward_log_probs(model, batch, with_entropy=True)
    assert lp.requires_grad and not h.requires_grad
    _, h_grad = forward_log_probs(model, batch, entropy_grad=True)
    torch.testing.assert_close(h_grad.detach(), h, rtol=0, atol=0)
