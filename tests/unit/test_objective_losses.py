"""high_entropy (80/20), CISPO, GSPO and the `candidates=` restriction of the covariance selections, checked against
an independent scalar implementation (plain Python floats and loops, written from docs/algorithms/losses.md)."""

import inspect
import math

import pytest
import torch

from entropy_openrlhf.algorithms.losses import (
    cispo_loss,
    clip_cov_select,
    gspo_loss,
    high_entropy_loss,
    high_entropy_select,
    kl_cov_select,
    ppo_loss,
)

NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------- independent reference (scalar Python)


def valid_tokens(mask):
    return [(b, t) for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]


def clamp20(x):
    return max(-20.0, min(20.0, x))


def ref_cov(lp, adv, mask):
    """Centred product over every valid token of the call."""
    toks = valid_tokens(mask)
    a_mean = sum(adv[b][t] for b, t in toks) / len(toks)
    l_mean = sum(lp[b][t] for b, t in toks) / len(toks)
    return {(b, t): (adv[b][t] - a_mean) * (lp[b][t] - l_mean) for b, t in toks}


def ref_select(ent, mask, top_frac):
    """(S, tau): every valid token whose entropy is at least the k-th largest valid entropy."""
    toks = valid_tokens(mask)
    if not toks:
        return set(), 0.0
    n = len(toks)
    k = min(max(1, int(top_frac * n + 0.9999)), n)
    tau = sorted((ent[b][t] for b, t in toks), reverse=True)[k - 1]
    return {(b, t) for b, t in toks if ent[b][t] >= tau}, tau


def ref_ppo_token(lp, old, a, lo, hi):
    """(loss, d loss / d lp, clipped low, clipped high) of PPO's clipped surrogate for one token."""
    raw = lp - old
    r = math.exp(clamp20(raw))
    unclipped = -a * r
    clipped = -a * min(max(r, 1.0 - lo), 1.0 + hi)
    grad = -a * r if unclipped >= clipped and abs(raw) <= 20.0 else 0.0
    return max(unclipped, clipped), grad, a < 0 and r < 1.0 - lo, a > 0 and r > 1.0 + hi


def ref_high_entropy(lp, old, adv, mask, ent, top_frac, lo, hi, w=None):
    sel, tau = ref_select(ent, mask, top_frac)
    denom = max(len(sel), 1)
    token, grad = {}, {}
    n_low = n_high = 0
    for b, t in sel:
        loss_t, g, low, high = ref_ppo_token(lp[b][t], old[b][t], adv[b][t], lo, hi)
        wt = 1.0 if w is None else w[b][t]
        token[b, t], grad[b, t] = loss_t * wt, g * wt / denom
        n_low, n_high = n_low + low, n_high + high
    toks = valid_tokens(mask)
    metrics = {
        "entropy_threshold": tau,
        "entropy_selected_frac": len(sel) / max(len(toks), 1),
        "ppo_kl": sum(old[b][t] - lp[b][t] for b, t in toks) / max(len(toks), 1),
        "ppo_clip_frac_low": n_low / denom,
        "ppo_clip_frac_high": n_high / denom,
    }
    return sum(token.values()) / denom, token, grad, sel, metrics


def ref_cispo(lp, old, adv, mask, lo, hi, w=None):
    toks = valid_tokens(mask)
    n = max(len(toks), 1)
    token, grad, n_clipped = {}, {}, 0
    for b, t in toks:
        r = math.exp(clamp20(lp[b][t] - old[b][t]))
        weight = min(max(r, 1.0 - lo), 1.0 + hi)
        n_clipped += weight != r
        wt = 1.0 if w is None else w[b][t]
        token[b, t] = -weight * adv[b][t] * lp[b][t] * wt
        grad[b, t] = -weight * adv[b][t] * wt / n
    return sum(token.values()) / n, token, grad, {"cispo_clip_frac": n_clipped / n}


def ref_gspo(lp, old, adv, mask, lo, hi, w=None):
    """Also returns the rows whose sequence ratio sits within 1e-6 of a clip bound (fp32 may decide those either
    way, so their gradient and clip status are not compared)."""
    rows = [[t for t in range(len(mask[0])) if mask[b][t]] for b in range(len(mask))]
    nonempty = [b for b in range(len(mask)) if rows[b]]
    n_seq = max(len(nonempty), 1)
    token, grad, near, clipped_rows, log_s_all = {}, {}, set(), set(), []
    total = 0.0
    for b in nonempty:
        n = len(rows[b])
        log_s = sum(clamp20(lp[b][t] - old[b][t]) for t in rows[b]) / n
        log_s_all.append(log_s)
        s = math.exp(log_s)
        if min(abs(s - (1.0 - lo)), abs(s - (1.0 + hi))) < 1e-6:
            near.add(b)
        seq_sum = 0.0
        for t in rows[b]:
            a = adv[b][t]
            wt = 1.0 if w is None else w[b][t]
            unclipped, clipped = -a * s, -a * min(max(s, 1.0 - lo), 1.0 + hi)
            token[b, t] = max(unclipped, clipped) * wt
            grad[b, t] = (-a * s * wt if unclipped >= clipped else 0.0) / (n * n_seq)
            if clipped > unclipped:
                clipped_rows.add(b)
            seq_sum += token[b, t]
        total += seq_sum / n
    metrics = {
        "gspo_clip_frac": len(clipped_rows) / n_seq,
        "seq_log_ratio_mean": sum(log_s_all) / len(log_s_all) if log_s_all else 0.0,
    }
    return total / n_seq, token, grad, metrics, near


# ---------------------------------------------------------------- random inputs


def make_batch(seed, B=6, L=9, spread=0.5, per_token_adv=False, ties=False, empty_row=False, min_len=1):
    """Log-probs, a perturbed old policy, advantages (per sequence, GRPO-like, or per token), entropies (optionally
    with many ties) and ragged masks; padding holds NaN/+inf/-inf in every input."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g) * 4.0
    old = lp + torch.randn(B, L, generator=g) * spread
    if per_token_adv:
        adv = torch.randn(B, L, generator=g) * 1.5
    else:
        adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, L).contiguous()
    ent = torch.rand(B, L, generator=g) * 3.0
    if ties:
        ent = (ent * 2).floor() / 2  # values 0, 0.5, ..., 2.5: ties everywhere, often straddling place k
    lengths = torch.randint(min_len, L + 1, (B,), generator=g)
    if empty_row:
        lengths[int(torch.randint(0, B, (1,), generator=g))] = 0
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    return dirty(lp, mask), dirty(old, mask, 1), dirty(adv, mask, 2), mask, dirty(ent, mask)


def dirty(x, mask, shift=0):
    garbage = torch.tensor([NAN, INF, -INF])[(torch.arange(x.numel()) + shift) % 3].view_as(x)
    return torch.where(mask.bool(), x, garbage)


def lists(*ts):
    return [t.tolist() for t in ts]


def as_set(sel):
    return {tuple(x) for x in sel.nonzero().tolist()}


def dense(values, shape):
    out = torch.zeros(shape, dtype=torch.float64)
    for (b, t), v in values.items():
        out[b, t] = v
    return out


def assert_grad(actual, expected, mask, skip_rows=()):
    """Autograd gradient vs the hand-derived one: finite everywhere, exactly 0 on padding."""
    assert torch.isfinite(actual).all()
    assert (actual[~mask.bool()] == 0).all()
    for b in range(actual.shape[0]):
        if b in skip_rows:
            continue
        assert torch.allclose(actual[b].double(), expected[b], rtol=1e-4, atol=1e-7), (b, actual[b], expected[b])


# ---------------------------------------------------------------- defaults


def _defaults(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_signature_defaults_are_the_documented_ones():
    common = {"normalizer": None, "dp_size": 1, "is_weights": None}
    assert _defaults(high_entropy_select) == {"top_frac": 0.2}
    assert _defaults(high_entropy_loss) == {
        "top_frac": 0.2,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "selected": None,
        **common,
    }
    assert _defaults(cispo_loss) == {"clip_low": 10.0, "clip_high": 0.2, "agg": "token_mean", **common}
    assert _defaults(gspo_loss) == {"clip_low": 3e-4, "clip_high": 4e-4, **common}
    assert _defaults(clip_cov_select)["candidates"] is None
    assert _defaults(kl_cov_select)["candidates"] is None
    for fn in (high_entropy_select, high_entropy_loss, cispo_loss, gspo_loss):
        kinds = {p.kind for name, p in inspect.signature(fn).parameters.items() if name in _defaults(fn)}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}


# ---------------------------------------------------------------- high_entropy: selection


@pytest.mark.parametrize("top_frac", [0.0, 0.07, 0.2, 0.3, 0.5, 1.0])
def test_high_entropy_select_matches_reference(top_frac):
    for seed in range(30):
        lp, old, adv, mask, ent = make_batch(seed, B=4 + seed % 5, L=5 + seed % 7, ties=seed % 2 == 0)
        sel = high_entropy_select(ent, mask, top_frac=top_frac)
        want, tau = ref_select(*lists(ent, mask), top_frac)
        assert sel.dtype == torch.bool and sel.shape == mask.shape
        assert as_set(sel) == want, (seed, top_frac)
        out = high_entropy_loss(lp, old, adv, mask, ent, top_frac=top_frac)
        assert torch.equal(out.selected, sel)
        assert out.metrics["entropy_threshold"] == pytest.approx(tau)


def test_high_entropy_select_pools_across_rows_and_any_shape():
    _, _, _, mask, ent = make_batch(3, B=5, L=8)
    want, _ = ref_select(*lists(ent, mask), 0.2)
    # the trainer's global scope: the valid tokens of a whole mini-batch as one (1, N) row
    row = ent[mask.bool()].view(1, -1)
    pooled = high_entropy_select(row, torch.ones_like(row), top_frac=0.2)
    grid = torch.zeros_like(mask, dtype=torch.bool)
    grid[mask.bool()] = pooled.view(-1)
    assert as_set(grid) == want
    # a per-row rule would keep at least one token in every row; the pooled rule does not have to
    assert as_set(high_entropy_select(ent, mask)) == want
    stacked = high_entropy_select(ent.view(1, 5, 8), mask.view(1, 5, 8), top_frac=0.2)
    assert as_set(stacked.view(5, 8)) == want


def test_rounding_cases():
    n = 100
    ent = torch.linspace(0.0, 1.0, n).view(1, n)  # distinct values
    mask = torch.ones(1, n)
    assert 0.07 * 100 > 7 and math.ceil(0.07 * 100) == 8  # the floating-point artefact the guard absorbs
    assert int(high_entropy_select(ent, mask, top_frac=0.07).sum()) == 7
    assert int(high_entropy_select(ent, mask, top_frac=0.071).sum()) == 8  # a real fraction still rounds up
    # within 1e-4 above an integer rounds down: 0.200005 * 10 = 2.00005
    assert int(high_entropy_select(ent[:, :10], mask[:, :10], top_frac=0.200005).sum()) == 2
    # rho = 0.3, N = 14: ceil(4.2) = 5; a linear-interpolation quantile threshold would keep only 4
    ent14, mask14 = ent[:, :14], mask[:, :14]
    assert int(high_entropy_select(ent14, mask14, top_frac=0.3).sum()) == 5
    assert int((ent14 >= torch.quantile(ent14, 0.7)).sum()) == 4
    # top_frac 0 keeps the argmax token (or all tokens tied at the max); 1 keeps every valid token
    assert as_set(high_entropy_select(ent, mask, top_frac=0.0)) == {(0, n - 1)}
    tied = ent.clone()
    tied[0, 3] = 1.0
    assert as_set(high_entropy_select(tied, mask, top_frac=0.0)) == {(0, 3), (0, n - 1)}
    _, _, _, rmask, rent = make_batch(5)
    assert torch.equal(high_entropy_select(rent, rmask, top_frac=1.0), rmask.bool())
    assert int(high_entropy_select(ent[:, :1], mask[:, :1], top_frac=1e-6).sum()) == 1
    assert int(high_entropy_select(ent[:, :10], mask[:, :10], top_frac=1e-6).sum()) == 1


def test_ties_straddling_place_k_are_all_kept():
    ent = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, NAN, INF]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 0, 0]])
    # N = 6, k = 3, the 3rd largest is 3 and three tokens hold it: 5 selected, padding (NaN, +inf) never
    assert as_set(high_entropy_select(ent, mask, top_frac=0.5)) == {(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)}
    lp = torch.full((1, 8), -1.0, requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, NAN, NAN]])
    out = high_entropy_loss(lp, lp.detach(), adv, mask, ent, top_frac=0.5)  # on-policy: loss_t = -A_t
    assert out.loss.item() == pytest.approx(-(1 + 2 + 3 + 4 + 5) / 5)
    assert out.metrics["entropy_threshold"] == 3.0
    assert out.metrics["entropy_selected_frac"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("bad", [-0.1, 1.0001, NAN, True, "0.2"])
def test_top_frac_outside_unit_interval_is_a_clear_error(bad):
    lp, old, adv, mask, ent = make_batch(0)
    with pytest.raises(ValueError, match="top_frac"):
        high_entropy_select(ent, mask, top_frac=bad)
    with pytest.raises(ValueError, match="top_frac"):
        high_entropy_loss(lp, old, adv, mask, ent, top_frac=bad)


# ---------------------------------------------------------------- high_entropy: loss


@pytest.mark.parametrize(
    "top_frac,lo,hi", [(0.2, 0.2, 0.2), (0.3, 0.2, 0.28), (0.07, 0.1, 0.1), (1.0, 0.2, 0.2), (0.0, 0.2, 0.2)]
)
def test_high_entropy_loss_matches_reference(top_frac, lo, hi):
    clipped_seen = 0
    for seed in range(25):
        lp, old, adv, mask, ent = make_batch(seed, B=3 + seed % 5, per_token_adv=seed % 3 == 0, ties=seed % 2 == 1)
        lp = lp.clone().requires_grad_(True)
        out = high_entropy_loss(lp, old, adv, mask, ent, top_frac=top_frac, clip_low=lo, clip_high=hi)
        loss, token, grad, sel, metrics = ref_high_entropy(*lists(lp.detach(), old, adv, mask, ent), top_frac, lo, hi)
        assert as_set(out.selected) == sel
        assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert torch.allclose(out.token_loss.double(), dense(token, mask.shape), rtol=1e-5, atol=1e-6)
        assert (out.token_loss[~out.selected] == 0).all()  # not selected: no loss, whatever the padding held
        for name, value in metrics.items():
            assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
        cov = ref_cov(*lists(lp.detach(), adv, mask))
        assert out.metrics["cov_mean"] == pytest.approx(sum(cov.values()) / len(cov), rel=1e-4, abs=1e-6)
        assert out.metrics["cov_selected_mean"] == pytest.approx(
            sum(cov[k] for k in sel) / len(sel), rel=1e-4, abs=1e-6
        )
        out.loss.backward()
        assert_grad(lp.grad, dense(grad, mask.shape), mask)
        clipped_seen += sum(1 for k in sel if grad[k] == 0.0 and adv[k].item() != 0)
    if top_frac > 0:
        assert clipped_seen > 0, "the inputs should exercise the clip"


def test_high_entropy_with_every_token_is_ppo():
    lp, old, adv, mask, ent = make_batch(8, B=6, L=10, ties=True)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    out = high_entropy_loss(a, old, adv, mask, ent, top_frac=1.0, clip_high=0.28)
    ref = ppo_loss(b, old, adv, mask, clip_high=0.28)
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    out.loss.backward()
    ref.loss.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-8)


def test_high_entropy_divides_by_selected_count_not_by_valid_tokens():
    # TRL multiplies by the entropy mask and divides by every valid token: N/|S| times too small a loss and gradient
    lp, _, adv, mask, ent = make_batch(7, B=6, L=10, per_token_adv=True)
    lp = lp.clone().requires_grad_(True)
    out = high_entropy_loss(lp, lp.detach(), adv, mask, ent)  # on-policy: loss_t = -A_t on S
    sel = as_set(out.selected)
    n_valid = int(mask.sum())
    assert 0 < len(sel) < n_valid / 3
    total = sum(-adv[k].item() for k in sel)
    assert out.loss.item() == pytest.approx(total / len(sel), rel=1e-5)
    assert out.loss.item() != pytest.approx(total / n_valid, rel=1e-2)
    out.loss.backward()
    for b, t in sel:
        assert lp.grad[b, t].item() == pytest.approx(-adv[b, t].item() / len(sel), rel=1e-5)
    assert (lp.grad[~out.selected] == 0).all()


def test_high_entropy_wider_selection_and_normalizer_make_splitting_invisible():
    lp, old, adv, mask, ent = make_batch(11, B=8, L=10)
    whole_sel = high_entropy_select(ent, mask)
    n_sel = int(whole_sel.sum())
    full_lp = lp.clone().requires_grad_(True)
    full = high_entropy_loss(full_lp, old, adv, mask, ent)
    assert torch.equal(full.selected, whole_sel)
    full.loss.backward()
    split_lp = lp.clone().requires_grad_(True)
    total = 0.0
    for idx in (slice(0, 3), slice(3, 8)):  # uneven micro-batches, the selection made over the whole
        part = high_entropy_loss(
            split_lp[idx], old[idx], adv[idx], mask[idx], None, selected=whole_sel[idx], normalizer=n_sel
        )
        assert torch.equal(part.selected, whole_sel[idx])
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-5)
    assert torch.allclose(split_lp.grad, full_lp.grad, atol=1e-7)
    # dp_size multiplies only together with a normalizer, as `aggregate` does
    one = high_entropy_loss(lp, old, adv, mask, ent, normalizer=n_sel).loss.item()
    assert high_entropy_loss(lp, old, adv, mask, ent, normalizer=n_sel, dp_size=4).loss.item() == pytest.approx(4 * one)
    assert high_entropy_loss(lp, old, adv, mask, ent, dp_size=4).loss.item() == pytest.approx(full.loss.item())
    # a larger normalizer scales the loss down
    assert high_entropy_loss(lp, old, adv, mask, ent, normalizer=2 * n_sel).loss.item() == pytest.approx(one / 2)


def test_high_entropy_given_selection_is_used_as_is_on_valid_tokens():
    lp, old, adv, mask, ent = make_batch(12, B=5, L=8, per_token_adv=True)
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(mask.shape, generator=g) < 0.4  # also True on some padding, which must be ignored
    out = high_entropy_loss(lp, old, adv, mask, ent, selected=chosen)
    assert torch.equal(out.selected, chosen & mask.bool())
    L_ = lists(lp, old, adv, mask)
    keep = as_set(chosen & mask.bool())
    expected = sum(ref_ppo_token(L_[0][b][t], L_[1][b][t], L_[2][b][t], 0.2, 0.2)[0] for b, t in keep) / len(keep)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.metrics["entropy_threshold"] == pytest.approx(min(ent[k].item() for k in keep))
    with pytest.raises(ValueError, match="entropy"):
        high_entropy_loss(lp, old, adv, mask, None)


def test_high_entropy_is_weights_multiply_the_token_loss():
    lp, old, adv, mask, ent = make_batch(13, B=6, L=9)
    w = dirty(torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 2.0, mask)
    lp = lp.clone().requires_grad_(True)
    out = high_entropy_loss(lp, old, adv, mask, ent, is_weights=w)
    loss, token, grad, _, _ = ref_high_entropy(*lists(lp.detach(), old, adv, mask, ent), 0.2, 0.2, 0.2, w.tolist())
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    assert torch.allclose(out.token_loss.double(), dense(token, mask.shape), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert_grad(lp.grad, dense(grad, mask.shape), mask)


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("lo,hi", [(10.0, 0.2), (0.2, 0.28), (1.0, 4.0), (0.0, 5.0)])
def test_cispo_matches_reference(lo, hi):
    clipped_seen = 0
    for seed in range(25):
        lp, old, adv, mask, _ = make_batch(seed, B=3 + seed % 5, spread=0.8, per_token_adv=seed % 2 == 0)
        lp = lp.clone().requires_grad_(True)
        out = cispo_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi)
        loss, token, grad, metrics = ref_cispo(*lists(lp.detach(), old, adv, mask), lo, hi)
        assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert torch.allclose(out.token_loss.double(), dense(token, mask.shape), rtol=1e-5, atol=1e-6)
        assert torch.equal(out.selected, mask.bool())
        assert out.metrics["cispo_clip_frac"] == pytest.approx(metrics["cispo_clip_frac"])
        toks = valid_tokens(mask.tolist())
        assert out.metrics["ppo_kl"] == pytest.approx(
            sum((old - lp.detach())[k].item() for k in toks) / len(toks), rel=1e-5, abs=1e-7
        )
        assert {"cov_mean", "cov_p99", "cov_max", "cov_selected_mean"} <= out.metrics.keys()
        out.loss.backward()
        assert_grad(lp.grad, dense(grad, mask.shape), mask)
        clipped_seen += metrics["cispo_clip_frac"] > 0
    assert clipped_seen > 0


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    lp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.1), NAN]], requires_grad=True)
    old = torch.tensor([[math.log(0.1), math.log(0.9), math.log(0.5), INF]])
    adv = torch.tensor([[1.0, -1.0, -2.0, NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # ratios 5, 1, 0.2: weights 1.2 (clipped high), 1, 0.8 (clipped low)
    out = cispo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    out.loss.backward()
    want = torch.tensor([[-1.2 * 1.0 / 3, 1.0 / 3, 0.8 * 2.0 / 3, 0.0]])
    assert torch.allclose(lp.grad, want, atol=1e-6)
    assert out.metrics["cispo_clip_frac"] == pytest.approx(2 / 3)
    # PPO with the same clip drops exactly those two tokens' gradients
    ppo_lp = lp.detach().clone().requires_grad_(True)
    ppo_loss(ppo_lp, old, adv, mask).loss.backward()
    assert ppo_lp.grad[0, 0] == 0 and ppo_lp.grad[0, 2] == 0 and ppo_lp.grad[0, 1] != 0


def test_cispo_default_has_no_lower_bound_and_loss_holds_logp():
    lp, old, adv, mask, _ = make_batch(21, spread=1.5)
    outs = [cispo_loss(lp, old, adv, mask, clip_low=lo) for lo in (1.0, 10.0, 100.0)]
    assert all(torch.equal(o.token_loss, outs[0].token_loss) for o in outs)
    assert not torch.equal(cispo_loss(lp, old, adv, mask, clip_low=0.5).token_loss, outs[0].token_loss)
    # on-policy every weight is 1: the loss is the token mean of -A*logp, not 0
    on = cispo_loss(lp, lp, adv, mask)
    toks = valid_tokens(mask.tolist())
    assert on.loss.item() == pytest.approx(sum(-(adv * lp)[k].item() for k in toks) / len(toks), rel=1e-5)
    assert on.metrics["cispo_clip_frac"] == 0.0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_cispo_normalizer_makes_splitting_invisible(agg):
    lp, old, adv, mask, _ = make_batch(22, B=8, L=10, spread=0.8, empty_row=True)
    full_lp = lp.clone().requires_grad_(True)
    full = cispo_loss(full_lp, old, adv, mask, agg=agg)
    full.loss.backward()
    if agg == "seq_mean_token_mean":  # the per-sequence mean, by hand
        rows = [valid_tokens(mask[b : b + 1].tolist()) for b in range(8)]
        per_seq = [sum(full.token_loss[b, t].item() for _, t in r) / len(r) for b, r in enumerate(rows) if r]
        assert full.loss.item() == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-5)
    norm = float(mask.sum()) if agg == "token_mean" else float((mask.sum(-1) > 0).sum())
    split_lp = lp.clone().requires_grad_(True)
    total = 0.0
    for idx in (slice(0, 3), slice(3, 8)):
        part = cispo_loss(split_lp[idx], old[idx], adv[idx], mask[idx], agg=agg, normalizer=norm, dp_size=2)
        (part.loss / 2).backward()
        total += part.loss.item() / 2
    assert total == pytest.approx(full.loss.item(), rel=1e-5)
    assert torch.allclose(split_lp.grad, full_lp.grad, atol=1e-7)


def test_cispo_is_weights_multiply_the_token_loss():
    lp, old, adv, mask, _ = make_batch(23, spread=0.8)
    w = dirty(torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) * 2.0, mask)
    lp = lp.clone().requires_grad_(True)
    out = cispo_loss(lp, old, adv, mask, is_weights=w)
    loss, _, grad, _ = ref_cispo(*lists(lp.detach(), old, adv, mask), 10.0, 0.2, w.tolist())
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    out.loss.backward()
    assert_grad(lp.grad, dense(grad, mask.shape), mask)


# ---------------------------------------------------------------- GSPO


@pytest.mark.parametrize("lo,hi,spread", [(3e-4, 4e-4, 1e-3), (0.2, 0.2, 0.3), (0.2, 0.28, 0.6)])
def test_gspo_matches_reference(lo, hi, spread):
    clipped = unclipped = 0
    for seed in range(25):
        lp, old, adv, mask, _ = make_batch(
            seed, B=3 + seed % 6, spread=spread, per_token_adv=seed % 4 == 0, empty_row=seed % 3 == 0
        )
        lp = lp.clone().requires_grad_(True)
        out = gspo_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi)
        loss, token, grad, metrics, near = ref_gspo(*lists(lp.detach(), old, adv, mask), lo, hi)
        assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert torch.allclose(out.token_loss.double(), dense(token, mask.shape), rtol=1e-5, atol=1e-6)
        assert torch.equal(out.selected, mask.bool())
        assert out.metrics["seq_log_ratio_mean"] == pytest.approx(metrics["seq_log_ratio_mean"], rel=1e-4, abs=1e-7)
        if not near:
            assert out.metrics["gspo_clip_frac"] == pytest.approx(metrics["gspo_clip_frac"])
        out.loss.backward()
        assert_grad(lp.grad, dense(grad, mask.shape), mask, skip_rows=near)
        n_seq = int((mask.sum(-1) > 0).sum())
        clipped += round(metrics["gspo_clip_frac"] * n_seq)
        unclipped += n_seq - round(metrics["gspo_clip_frac"] * n_seq)
    assert clipped > 0 and unclipped > 0, "the inputs should clip some sequences and not others"


def test_gspo_clamps_each_token_before_the_mean_and_differentiates_raw_logp():
    # row 0: one token 50 above old and four on-policy. Per-token clamp: log s = (20 + 0) / 5 = 4. Clamping the mean
    # instead (or verl's clamp(max=10) of it) would give 10.
    # row 1: one token 30 below old: log s = -20.
    lp = torch.tensor([[50.0, 0.0, 0.0, 0.0, 0.0], [-30.0, NAN, NAN, NAN, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, INF, INF, INF, INF]])
    adv = torch.tensor([[-1.0] * 5, [1.0] + [NAN] * 4])
    mask = torch.tensor([[1.0] * 5, [1.0, 0, 0, 0, 0]])
    out = gspo_loss(lp, old, adv, mask)
    assert out.metrics["seq_log_ratio_mean"] == pytest.approx((4.0 - 20.0) / 2)
    s0, s1 = math.exp(4.0), math.exp(-20.0)
    # A < 0 and s0 above the clip: the unclipped branch is the max, so every token of row 0 has loss s0 and
    # gradient s0 / (n * B'); row 1 (A > 0, s below the clip) has loss -s1 and gradient -s1 / (1 * 2).
    assert out.token_loss[0].tolist() == pytest.approx([s0] * 5, rel=1e-5)
    assert out.loss.item() == pytest.approx((s0 - s1) / 2, rel=1e-5)
    out.loss.backward()
    # the gradient runs through the raw logp: also on the token whose log ratio the clamp held at 20
    assert lp.grad[0].tolist() == pytest.approx([s0 / 10] * 5, rel=1e-5)
    assert lp.grad[1, 0].item() == pytest.approx(-s1 / 2, rel=1e-4)
    assert (lp.grad[1, 1:] == 0).all()


def test_gspo_clips_a_sequence_as_a_whole():
    zero_rows = 0
    for seed in range(20):
        lp, old, adv, mask, _ = make_batch(seed, B=8, L=10, spread=1e-3, empty_row=True)
        lp = lp.clone().requires_grad_(True)
        out = gspo_loss(lp, old, adv, mask)
        out.loss.backward()
        rows = [b for b in range(8) if mask[b].sum() > 0]
        dead = 0
        for b in rows:
            g = lp.grad[b][mask[b].bool()]
            assert (g == 0).all() or (g != 0).all()  # advantages are constant per sequence
            dead += bool((g == 0).all())
        assert out.metrics["gspo_clip_frac"] == pytest.approx(dead / len(rows))
        zero_rows += dead
    assert zero_rows > 0


def test_gspo_is_seq_mean_token_mean_without_empty_rows():
    lp = torch.tensor([[-1.0, NAN, NAN, NAN], [-1.0, -2.0, -0.5, -3.0], [NAN, NAN, NAN, NAN]])
    adv = torch.tensor([[1.0, NAN, NAN, NAN], [2.0, 2.0, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 1], [0.0, 0, 0, 0]])
    out = gspo_loss(lp, lp, adv, mask)  # on-policy: s = 1, loss_t = -A
    # per sequence, then over the 2 non-empty sequences: -(1 + 2) / 2. A token mean would give -(1 + 8) / 5 and a
    # mean over all 3 rows -(1 + 2) / 3.
    assert out.loss.item() == pytest.approx(-1.5)
    assert out.metrics["gspo_clip_frac"] == 0.0


def test_gspo_normalizer_makes_splitting_invisible_and_is_weights_multiply():
    lp, old, adv, mask, _ = make_batch(31, B=8, L=10, spread=1e-3, empty_row=True)
    full_lp = lp.clone().requires_grad_(True)
    full = gspo_loss(full_lp, old, adv, mask)
    full.loss.backward()
    n_seq = float((mask.sum(-1) > 0).sum())
    split_lp = lp.clone().requires_grad_(True)
    total = 0.0
    for idx in (slice(0, 3), slice(3, 8)):
        part = gspo_loss(split_lp[idx], old[idx], adv[idx], mask[idx], normalizer=n_seq)
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-5)
    assert torch.allclose(split_lp.grad, full_lp.grad, atol=1e-7)
    one = gspo_loss(lp, old, adv, mask, normalizer=n_seq).loss.item()
    assert gspo_loss(lp, old, adv, mask, normalizer=n_seq, dp_size=3).loss.item() == pytest.approx(3 * one)
    w = dirty(torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) * 2.0, mask)
    w_lp = lp.clone().requires_grad_(True)
    out = gspo_loss(w_lp, old, adv, mask, is_weights=w)
    loss, _, grad, _, near = ref_gspo(*lists(lp, old, adv, mask), 3e-4, 4e-4, w.tolist())
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    out.loss.backward()
    assert_grad(w_lp.grad, dense(grad, mask.shape), mask, skip_rows=near)


def test_gspo_needs_fp32_and_computes_in_it():
    lp, old, adv, mask, _ = make_batch(32, spread=1e-3)
    out = gspo_loss(lp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    ref = gspo_loss(lp.bfloat16().float(), old.bfloat16().float(), adv.bfloat16().float(), mask)
    assert out.loss.dtype == torch.float32 and out.token_loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)


# ---------------------------------------------------------------- shared guards


def _call(name, lp, old, adv, mask, ent):
    if name == "high_entropy":
        return high_entropy_loss(lp, old, adv, mask, ent)
    return {"cispo": cispo_loss, "gspo": gspo_loss}[name](lp, old, adv, mask)


NAMES = ["high_entropy", "cispo", "gspo"]


@pytest.mark.parametrize("name", NAMES)
def test_all_padding_gives_zero_loss_with_a_gradient_path(name):
    lp = torch.full((3, 5), NAN, requires_grad=True)
    garbage = torch.full((3, 5), INF)
    mask = torch.zeros(3, 5)
    out = _call(name, lp, -garbage, garbage, mask, torch.full((3, 5), NAN))
    assert out.loss.item() == 0.0
    assert out.loss.requires_grad
    out.loss.backward()
    assert (lp.grad == 0).all()
    assert (out.token_loss == 0).all() and not out.selected.any()
    assert all(math.isfinite(v) for v in out.metrics.values())
    if name == "high_entropy":
        assert not high_entropy_select(torch.full((3, 5), NAN), mask).any()


@pytest.mark.parametrize("name", NAMES)
def test_padding_garbage_changes_nothing_and_inputs_are_not_modified(name):
    lp, old, adv, mask, ent = make_batch(41, B=5, L=8, empty_row=True)
    clean = [torch.where(mask.bool(), x, 0.0) for x in (lp, old, adv, ent)]
    ref = _call(name, *clean[:3], mask, clean[3])
    before = [x.clone() for x in (lp, old, adv, mask, ent)]
    dirty_lp = lp.clone().requires_grad_(True)
    out = _call(name, dirty_lp, old, adv, mask, ent)
    for x, y in zip((lp, old, adv, mask, ent), before, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    assert torch.equal(out.token_loss, ref.token_loss) and torch.equal(out.selected, ref.selected)
    assert all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert torch.isfinite(dirty_lp.grad).all() and (dirty_lp.grad[~mask.bool()] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_math_is_fp32_for_bf16_inputs(name):
    lp, old, adv, mask, ent = make_batch(42, spread=0.3)
    low = [x.bfloat16() for x in (lp, old, adv)]
    out = _call(name, *low, mask, ent.bfloat16())
    ref = _call(name, *[x.float() for x in low], mask, ent.bfloat16().float())
    assert out.loss.dtype == torch.float32 and out.token_loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)


@pytest.mark.parametrize("name", ["cispo", "gspo"])
def test_negative_clip_width_is_an_error(name):
    lp, old, adv, mask, _ = make_batch(0)
    fn = {"cispo": cispo_loss, "gspo": gspo_loss}[name]
    with pytest.raises(ValueError, match="clip"):
        fn(lp, old, adv, mask, clip_low=-0.1)


# ---------------------------------------------------------------- candidates= of the covariance selections


def ref_kl_cov_within(lp, adv, mask, cand, ratio):
    cov = ref_cov(lp, adv, mask)  # centred on every valid token
    pool = [k for k in cov if cand[k[0]][k[1]]]
    k = min(max(1, math.floor(ratio * len(cov))), len(pool))
    return set(sorted(pool, key=lambda x: cov[x], reverse=True)[:k])


def ref_clip_cov_pool(lp, old, adv, mask, cand, lb, ub, lo, hi):
    cov = ref_cov(lp, adv, mask)
    out = set()
    for (b, t), c in cov.items():
        r = math.exp(clamp20(lp[b][t] - old[b][t]))
        a = adv[b][t]
        ppo_clipped = -a * min(max(r, 1 - lo), 1 + hi) > -a * r
        if cand[b][t] and lb < c < ub and not ppo_clipped:
            out.add((b, t))
    return out


def wide_batch(seed):
    """Spread-out log-probs and advantages, so that several covariances fall inside Clip-Cov's (1, 5)."""
    lp, old, adv, mask, ent = make_batch(seed, B=8, L=12, spread=0.2)
    return lp * 2.0, old * 2.0, adv * 2.0, mask, ent


@pytest.mark.parametrize("ratio", [1e-3, 0.05, 0.15, 0.6, 1.0])
def test_kl_cov_select_within_candidates(ratio):
    for seed in range(15):
        lp, old, adv, mask, ent = make_batch(seed, B=6, L=10, per_token_adv=seed % 2 == 0)
        cand = high_entropy_select(ent, mask, top_frac=0.3) | ~mask.bool()  # True on padding too: must not count
        sel = kl_cov_select(lp, adv, mask, ratio=ratio, candidates=cand)
        assert as_set(sel) == ref_kl_cov_within(*lists(lp, adv, mask, cand), ratio), (seed, ratio)
    # None = the unrestricted choice, and so is a restriction to every token
    assert torch.equal(
        kl_cov_select(lp, adv, mask, ratio=0.1), kl_cov_select(lp, adv, mask, ratio=0.1, candidates=None)
    )
    every = torch.ones_like(mask, dtype=torch.bool)
    assert torch.equal(
        kl_cov_select(lp, adv, mask, ratio=0.1), kl_cov_select(lp, adv, mask, ratio=0.1, candidates=every)
    )
    assert not kl_cov_select(lp, adv, mask, ratio=0.1, candidates=~mask.bool()).any()


def _centring_case():
    # Six non-candidates (A = 5, logp = 0) and three candidates. Centred on all nine tokens the candidates'
    # covariances are 0.78, 5.78, 7.78; centred on the candidates alone they would be 1, 0, 0.
    lp = torch.tensor([[0.0] * 6 + [-1.0, -2.0, -3.0, NAN]])
    adv = torch.tensor([[5.0] * 6 + [1.0, -1.0, 0.0, NAN]])
    mask = torch.tensor([[1.0] * 9 + [0.0]])
    cand = torch.tensor([[False] * 6 + [True, True, True, True]])
    return lp, adv, mask, cand


def test_kl_cov_within_keeps_the_quota_and_centring_of_all_valid_tokens():
    lp, adv, mask, cand = _centring_case()
    # K = max(1, floor(0.1 * 9)) = 1: the candidate of largest covariance centred on all tokens is the last one
    assert as_set(kl_cov_select(lp, adv, mask, ratio=0.1, candidates=cand)) == {(0, 8)}
    # K = floor(0.5 * 9) = 4, capped at the 3 candidates; a quota counted on candidates would give 1
    assert as_set(kl_cov_select(lp, adv, mask, ratio=0.5, candidates=cand)) == {(0, 6), (0, 7), (0, 8)}
    # unrestricted, the same quota also takes non-candidates (covariance 1.11 each, above the first candidate's)
    free = as_set(kl_cov_select(lp, adv, mask, ratio=0.5))
    assert len(free) == 4 and {(0, 7), (0, 8)} <= free and (0, 6) not in free


def test_clip_cov_select_within_candidates():
    checked_quota = 0
    for seed in range(12):
        lp, old, adv, mask, ent = wide_batch(seed)
        n_valid = int(mask.sum())
        cand = high_entropy_select(ent, mask, top_frac=0.5) | ~mask.bool()
        pool = ref_clip_cov_pool(*lists(lp, old, adv, mask, cand), 1.0, 5.0, 1.0, 1.0)
        # ratio 1: everything in the restricted pool, nothing outside it
        sel = clip_cov_select(lp, old, adv, mask, ratio=1.0, candidates=cand)
        assert as_set(sel) == pool, seed
        # the quota counts every valid token: 3 here, where counting the candidates would give 1
        ratio = 3.5 / n_valid
        sel = clip_cov_select(
            lp, old, adv, mask, ratio=ratio, candidates=cand, generator=torch.Generator().manual_seed(seed)
        )
        assert as_set(sel) <= pool
        assert int(sel.sum()) == min(3, len(pool))
        checked_quota += len(pool) >= 3 and math.floor(ratio * int((cand & mask.bool()).sum())) < 3
    assert checked_quota > 0
    # None = the unrestricted choice (same draw with the same seed), and so is a restriction to every token
    every = torch.ones_like(mask, dtype=torch.bool)
    a = clip_cov_select(lp, old, adv, mask, ratio=0.05, generator=torch.Generator().manual_seed(1))
    b = clip_cov_select(lp, old, adv, mask, ratio=0.05, generator=torch.Generator().manual_seed(1), candidates=None)
    c = clip_cov_select(lp, old, adv, mask, ratio=0.05, generator=torch.Generator().manual_seed(1), candidates=every)
    assert torch.equal(a, b) and torch.equal(a, c) and a.any()


def test_clip_cov_within_keeps_the_centring_of_all_valid_tokens():
    lp, adv, mask, cand = _centring_case()
    # on-policy (never PPO-clipped); bounds (5, 10): centred on all tokens two candidates qualify, centred on the
    # candidates alone none would
    sel = clip_cov_select(lp, lp, adv, mask, ratio=1.0, cov_lb=5.0, cov_ub=10.0, candidates=cand)
    assert as_set(sel) == {(0, 7), (0, 8)}


def test_shape_mismatch_of_candidates_is_an_error():
    lp, old, adv, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="candidates"):
        kl_cov_select(lp, adv, mask, candidates=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="candidates"):
        clip_cov_select(lp, old, adv, mask, candidates=torch.ones(2, 2, dtype=torch.bool))
