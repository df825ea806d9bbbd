"""Entropy and covariance telemetry against independent numpy / plain-Python implementations."""

import math

import numpy as np
import pytest
import torch

from entropy_openrlhf.algorithms.metrics import covariance_stats, entropy_stats, token_entropy


def ref_entropy(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """-sum p log p in float64, p = softmax(z / T), computed row by row."""
    z = logits.astype(np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p = p / p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return -plogp.sum(axis=-1)


def random_logits(seed=0, shape=(3, 5, 50), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# ---------------------------------------------------------------- token_entropy


def test_token_entropy_fp32_matches_reference():
    logits = random_logits()
    out = token_entropy(logits)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref_entropy(logits.numpy()), rtol=1e-5, atol=1e-5)
    # the entropies are spread out, so a 1 % deviation anywhere would show
    assert out.min() > 0.01 and out.max() - out.min() > 1.0 and out.max() < math.log(50)


def test_token_entropy_bf16_input_is_computed_in_fp32():
    logits = random_logits(seed=1).bfloat16()
    out = token_entropy(logits)
    assert out.dtype == torch.float32
    # the reference sees exactly the bf16 values, widened to float64
    np.testing.assert_allclose(out.numpy(), ref_entropy(logits.float().numpy()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_token_entropy_temperature(temperature):
    logits = random_logits(seed=2)
    out = token_entropy(logits, temperature=temperature)
    np.testing.assert_allclose(out.numpy(), ref_entropy(logits.numpy(), temperature), rtol=1e-5, atol=1e-5)
    # and it really differs from T = 1 (lower T sharpens, higher T flattens)
    base = token_entropy(logits)
    assert (out < base).all() if temperature < 1 else (out > base).all()


def test_token_entropy_chunk_size_does_not_change_the_result():
    logits = random_logits(seed=3, shape=(3, 5, 50))  # 15 rows: chunk 3 divides them, 4 and 7 leave a remainder
    ref = token_entropy(logits, chunk_size=1024)
    for chunk in (1, 3, 4, 7, 15, 1024):
        out = token_entropy(logits, chunk_size=chunk)
        assert torch.allclose(out, ref, rtol=0, atol=1e-6), chunk
    np.testing.assert_allclose(ref.numpy(), ref_entropy(logits.numpy()), rtol=1e-5, atol=1e-5)


def test_token_entropy_uniform_and_peaked():
    V = 37
    uniform = torch.full((2, 4, V), 1.7)
    np.testing.assert_allclose(token_entropy(uniform, chunk_size=3).numpy(), math.log(V), rtol=1e-6)
    peaked = torch.zeros(1, V)
    peaked[0, 5] = 60.0  # p(other) ~ e^-60: entropy ~ 36 * 61 e^-60 ~ 0
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    # two equal peaks: log 2
    two = torch.full((1, V), -50.0)
    two[0, [1, 2]] = 10.0
    assert token_entropy(two).item() == pytest.approx(math.log(2), rel=1e-5)


def test_token_entropy_is_detached_and_keeps_leading_shape():
    logits = random_logits(seed=4, shape=(2, 3, 4, 11)).requires_grad_(True)
    out = token_entropy(logits, chunk_size=5)
    assert out.shape == (2, 3, 4)
    assert not out.requires_grad
    np.testing.assert_allclose(out.numpy(), ref_entropy(logits.detach().numpy()), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- entropy_stats


def test_entropy_stats_token_mean_vs_seq_mean_by_hand():
    entropy = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],
            [10.0, 99.0, 99.0, 99.0],  # one valid token; the 99s are padding
            [5.0, 5.0, 5.0, 5.0],  # empty row: no valid token
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    stats = entropy_stats(entropy, mask)
    # token_mean: (1 + 2 + 3 + 4 + 10) / 5 = 4.0
    # seq_mean: mean of the two non-empty rows' token means, ((1+2+3+4)/4 + 10/1) / 2 = (2.5 + 10) / 2 = 6.25
    assert stats["token_mean"] == pytest.approx(4.0)
    assert stats["seq_mean"] == pytest.approx(6.25)


def test_entropy_stats_equal_lengths_agree_and_padding_garbage_is_ignored():
    entropy = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 6.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    stats = entropy_stats(entropy, mask)
    # equal lengths: both are (1 + 3 + 2 + 6) / 4 = 3.0
    assert stats == {"token_mean": pytest.approx(3.0), "seq_mean": pytest.approx(3.0)}


def test_entropy_stats_empty_mask():
    assert entropy_stats(torch.ones(2, 3), torch.zeros(2, 3)) == {"token_mean": 0.0, "seq_mean": 0.0}


# ---------------------------------------------------------------- covariance_stats


def ref_covariance_stats(lp, adv, mask):
    vals_lp = [lp[b][t] for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]
    vals_a = [adv[b][t] for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]
    n = len(vals_lp)
    ml, ma = sum(vals_lp) / n, sum(vals_a) / n
    cov = [(a - ma) * (lv - ml) for a, lv in zip(vals_a, vals_lp)]
    return {
        "mean": sum(cov) / n,
        "p99": float(np.percentile(np.array(cov, dtype=np.float64), 99)),  # linear interpolation, as torch
        "max": max(cov),
        "min": min(cov),
        "frac_positive": sum(c > 0 for c in cov) / n,
    }


def test_covariance_stats_match_reference():
    g = torch.Generator().manual_seed(5)
    B, L = 7, 13
    lp = -torch.rand(B, L, generator=g) * 5.0
    adv = (torch.randn(B, 1, generator=g) * 2.0).expand(B, L).contiguous()
    lengths = torch.tensor([13, 1, 5, 9, 0, 13, 4])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    # garbage on padding must not enter the means
    lp = torch.where(mask.bool(), lp, torch.tensor(1e6))
    adv = torch.where(mask.bool(), adv, torch.tensor(float("nan")))
    got = covariance_stats(lp, adv, mask)
    want = ref_covariance_stats(lp.tolist(), adv.tolist(), mask.tolist())
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert 0.0 < got["frac_positive"] < 1.0
    assert got["min"] < 0 < got["max"]


def test_covariance_stats_sign_by_hand():
    # two tokens: A = 1, 1 at logp -1, -3 and A = -1 at logp -2; means A = 1/3, logp = -2
    # cov = (2/3)(1), (2/3)(-1), (-4/3)(0) = 2/3, -2/3, 0 -> mean 0, max 2/3, min -2/3, 1/3 positive
    lp = torch.tensor([[-1.0, -3.0, -2.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    got = covariance_stats(lp, adv, torch.ones(1, 3))
    assert got["mean"] == pytest.approx(0.0, abs=1e-7)
    assert got["max"] == pytest.approx(2 / 3)
    assert got["min"] == pytest.approx(-2 / 3)
    assert got["frac_positive"] == pytest.approx(1 / 3)
    # confident tokens with high advantage: positive covariance (entropy falls)
    got = covariance_stats(torch.tensor([[-0.1, -3.0]]), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    # means A = 0, logp = -1.55: (1)(1.45) = 1.45, (-1)(-1.45) = 1.45
    assert got["mean"] == pytest.approx(1.45, rel=1e-6)
    assert got["frac_positive"] == 1.0


def test_covariance_stats_empty_mask():
    got = covariance_stats(torch.ones(2, 2), torch.ones(2, 2), torch.zeros(2, 2))
    assert got == {"mean": 0.0, "p99": 0.0, "max": 0.0, "min": 0.0, "frac_positive": 0.0}
