"""Selection scope `global`: one covariance selection over the whole optimizer mini-batch, across micro-batches and
data-parallel ranks (entropy_openrlhf/algorithms/selection.py).

Sequences are kept as ragged 1-D tensors; a micro-batch pads its own sequences to its own longest one (with NaN, so
padding that leaked anywhere would show), and selections are mapped back to (sequence, token) pairs to compare
different splits. The independent references are plain Python over those pairs.
"""

import datetime
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from entropy_openrlhf.algorithms.losses import clip_cov_loss, kl_cov_loss, token_covariance
from entropy_openrlhf.algorithms.objectives import LossContext, TokenBatch, select_tokens
from entropy_openrlhf.algorithms.objectives.clip_cov import ClipCovConfig
from entropy_openrlhf.algorithms.objectives.kl_cov import KLCovConfig
from entropy_openrlhf.algorithms.selection import MicroBatch, _comm_device, global_selection, pooled_selection

LENGTHS = [5, 9, 3, 12, 7, 1, 10, 6]  # 53 valid tokens
SPLITS = [[8], [4, 4], [3, 5], [1, 1, 6]]
CLIP_COV = {"ratio": 0.1, "cov_lb": 1.0, "cov_ub": 5.0, "clip_low": 1.0, "clip_high": 1.0}
KL_RATIO = 0.1
SEED = 1234


# ---------------------------------------------------------------- data helpers


def make_seqs(seed=0, lengths=LENGTHS, lp_scale=8.0, adv_scale=3.0, spread=0.4):
    """Per sequence: current log-probs, a perturbed old policy, one advantage repeated over its tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        lp = -torch.rand(n, generator=g) * lp_scale
        old = lp + torch.randn(n, generator=g) * spread
        adv = torch.full((n,), float(torch.randn(1, generator=g)) * adv_scale)
        seqs.append({"lp": lp, "old": old, "adv": adv})
    return seqs


def pad(seqs, ids):
    """One micro-batch of the sequences `ids`, padded with NaN to their own longest length."""
    width = max(len(seqs[i]["lp"]) for i in ids)
    out = {k: torch.full((len(ids), width), float("nan")) for k in ("lp", "old", "adv")}
    mask = torch.zeros(len(ids), width)
    for row, i in enumerate(ids):
        n = len(seqs[i]["lp"])
        for k in out:
            out[k][row, :n] = seqs[i][k]
        mask[row, :n] = 1.0
    return MicroBatch(out["lp"], out["old"], out["adv"], mask)


def split_ids(sizes, start=0):
    ids, out = start, []
    for s in sizes:
        out.append(list(range(ids, ids + s)))
        ids += s
    return out


def to_pairs(masks, id_groups):
    """Selection masks of micro-batches -> {(sequence, token)}."""
    return {(ids[row], t) for m, ids in zip(masks, id_groups) for row, t in m.nonzero().tolist()}


def select(seqs, sizes, method, seed=SEED, **kw):
    groups = split_ids(sizes)
    kw = dict(CLIP_COV if method == "clip_cov" else {"ratio": KL_RATIO}, **kw)
    gen = torch.Generator().manual_seed(seed) if method == "clip_cov" else None
    masks, means = global_selection([pad(seqs, g) for g in groups], method, generator=gen, **kw)
    for m, g in zip(masks, groups):
        assert m.dtype == torch.bool and m.shape == pad(seqs, g).mask.shape
    return to_pairs(masks, groups), means


# ---------------------------------------------------------------- independent reference (plain Python)


def ref_tokens(seqs):
    """All valid tokens in (sequence, token) order with their values as floats."""
    return [
        (i, t, float(s["lp"][t]), float(s["old"][t]), float(s["adv"][t]))
        for i, s in enumerate(seqs)
        for t in range(len(s["lp"]))
    ]


def ref_cov(seqs):
    toks = ref_tokens(seqs)
    ma = sum(x[4] for x in toks) / len(toks)
    ml = sum(x[2] for x in toks) / len(toks)
    return {(i, t): (a - ma) * (lp - ml) for i, t, lp, _, a in toks}, (ma, ml)


def ref_kl_top(seqs, ratio):
    cov, _ = ref_cov(seqs)
    k = max(1, math.floor(ratio * len(cov)))
    return set(sorted(cov, key=cov.get, reverse=True)[:k])


def ref_ppo_token(lp, old, a, lo, hi):
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    u1, u2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    return max(u1, u2), u2 > u1


def ref_clip_candidates(seqs, lb=1.0, ub=5.0, lo=1.0, hi=1.0):
    cov, _ = ref_cov(seqs)
    return {
        (i, t)
        for i, t, lp, old, a in ref_tokens(seqs)
        if lb < cov[(i, t)] < ub and not ref_ppo_token(lp, old, a, lo, hi)[1]
    }


def ref_loss(seqs, method, selected, coef=1.0, lo=1.0, hi=1.0):
    toks = ref_tokens(seqs)
    total = 0.0
    for i, t, lp, old, a in toks:
        d = max(-20.0, min(20.0, lp - old))
        if method == "kl_cov":
            total += -a * math.exp(d) + (coef * abs(d) if (i, t) in selected else 0.0)
        elif (i, t) not in selected:
            total += ref_ppo_token(lp, old, a, lo, hi)[0]
    return total / len(toks)


# ---------------------------------------------------------------- one micro-batch, one rank


def test_reference_data_has_a_real_choice():
    seqs = make_seqs()
    n = sum(LENGTHS)
    cands = ref_clip_candidates(seqs)
    quota = max(1, math.floor(CLIP_COV["ratio"] * n))
    assert quota == 5 and len(cands) > quota + 3  # Clip-Cov draws 5 of more candidates: randomness matters
    assert max(1, math.floor(KL_RATIO * n)) == 5


def test_single_micro_batch_kl_cov_equals_loss_selection():
    seqs = make_seqs()
    mb = pad(seqs, list(range(8)))
    masks, means = global_selection([mb], "kl_cov", ratio=KL_RATIO)
    own = kl_cov_loss(mb.log_probs, mb.old_log_probs, mb.advantages, mb.mask, ratio=KL_RATIO).selected
    assert torch.equal(masks[0], own)
    assert int(own.sum()) == 5
    _, (ma, ml) = ref_cov(seqs)
    assert means == (pytest.approx(ma, rel=1e-6), pytest.approx(ml, rel=1e-6))


def test_single_micro_batch_clip_cov_equals_loss_selection():
    seqs = make_seqs()
    mb = pad(seqs, list(range(8)))
    for seed in range(20):  # the same seeded generator both ways, for many draws
        masks, _ = global_selection([mb], "clip_cov", generator=torch.Generator().manual_seed(seed), **CLIP_COV)
        own = clip_cov_loss(
            mb.log_probs, mb.old_log_probs, mb.advantages, mb.mask, generator=torch.Generator().manual_seed(seed),
            **CLIP_COV,
        ).selected  # fmt: skip
        assert torch.equal(masks[0], own), seed
        assert int(own.sum()) == 5


# ---------------------------------------------------------------- independence of the micro-batch split


@pytest.mark.parametrize("method", ["kl_cov", "clip_cov"])
def test_global_selection_does_not_depend_on_the_split(method):
    seqs = make_seqs()
    results = [select(seqs, sizes, method) for sizes in SPLITS]
    first, means = results[0]
    assert len(first) == 5
    for (pairs, m), sizes in zip(results[1:], SPLITS[1:]):
        assert pairs == first, sizes
        assert m == means
    if method == "kl_cov":
        assert first == ref_kl_top(seqs, KL_RATIO)
    else:
        assert first <= ref_clip_candidates(seqs)
        # another seed draws other candidates, again the same for every split
        other = [select(seqs, sizes, method, seed=SEED + 1)[0] for sizes in SPLITS]
        assert all(o == other[0] for o in other) and other[0] != first


def test_global_differs_from_per_micro_batch_and_equals_the_top_k_over_all_tokens():
    # Sequences 0-3 carry large advantages and spread-out log-probs (all the large covariances); sequences 4-7
    # carry tiny advantages. Per micro-batch ([4, 4]), the second micro-batch still gets its own top tokens; over
    # the whole mini-batch, none of its tokens is among the top.
    big = make_seqs(seed=1, lengths=LENGTHS[:4], adv_scale=3.0)
    small = make_seqs(seed=2, lengths=LENGTHS[4:], adv_scale=0.01)
    for s, sign in zip(big, (1, -1, 1, -1)):
        s["adv"] = s["adv"].abs() * sign  # both signs, so covariances are large both ways
    seqs = big + small
    groups = split_ids([4, 4])
    per_micro = set()
    for g in groups:
        mb = pad(seqs, g)
        sel = kl_cov_loss(mb.log_probs, mb.old_log_probs, mb.advantages, mb.mask, ratio=KL_RATIO).selected
        per_micro |= to_pairs([sel], [g])
    glob, _ = select(seqs, [4, 4], "kl_cov")
    want = ref_kl_top(seqs, KL_RATIO)
    assert glob == want
    assert len(glob) == 5  # floor(0.1 * 53)
    assert all(i < 4 for i, _ in glob)
    assert any(i >= 4 for i, _ in per_micro)  # the per-micro-batch scope picked low-covariance tokens
    assert per_micro != glob
    assert len(per_micro) == 2 + 2  # floor(0.1 * 29) + floor(0.1 * 24)


def test_global_clip_cov_candidates_are_those_of_the_whole_mini_batch():
    # With ratio 1 the quota covers every candidate, so the draw returns the candidate set itself.
    seqs = make_seqs()
    glob, _ = select(seqs, [3, 5], "clip_cov", ratio=1.0)
    assert glob == ref_clip_candidates(seqs)
    per_micro = set()
    for g in split_ids([3, 5]):
        mb = pad(seqs, g)
        sel = clip_cov_loss(mb.log_probs, mb.old_log_probs, mb.advantages, mb.mask, **dict(CLIP_COV, ratio=1.0))
        per_micro |= to_pairs([sel.selected], [g])
    assert per_micro != glob  # per micro-batch, the centring (and so the candidate set) differs


def test_global_selection_edge_cases():
    seqs = make_seqs()
    # a micro-batch without valid tokens in the middle of the mini-batch
    empty = MicroBatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    mbs = [pad(seqs, [0, 1, 2]), empty, pad(seqs, [3, 4, 5, 6, 7])]
    masks, _ = global_selection(mbs, "kl_cov", ratio=KL_RATIO)
    assert not masks[1].any()
    assert to_pairs([masks[0], masks[2]], [[0, 1, 2], [3, 4, 5, 6, 7]]) == ref_kl_top(seqs, KL_RATIO)
    # nothing valid at all
    masks, means = global_selection([empty], "kl_cov", ratio=KL_RATIO)
    assert not masks[0].any() and means == (0.0, 0.0)
    masks, _ = global_selection([empty], "clip_cov", **CLIP_COV)
    assert not masks[0].any()
    with pytest.raises(ValueError, match="unknown selection method 'ppo'"):
        global_selection([pad(seqs, [0])], "ppo", ratio=0.1)


# ---------------------------------------------------------------- tokens the off-policy correction rejected


def weighted(mb, rejected_ids, ids):
    """mb as a TokenBatch whose off-policy weights are 0 on the sequences `rejected_ids` (of `ids`) and 0.7 on the
    others' tokens (a truncated weight: not 1, so a weight is not mistaken for a mask)."""
    w = torch.where(mb.mask.bool(), torch.tensor(0.7), torch.tensor(0.0))
    for row, i in enumerate(ids):
        if i in rejected_ids:
            w[row] = 0.0
    return TokenBatch(mb.log_probs, mb.old_log_probs, mb.advantages, mb.mask, is_weights=w)


def top_sequence(seqs):
    cov, _ = ref_cov(seqs)
    return max(cov, key=cov.get)[0]


@pytest.mark.parametrize("scope", ["micro_batch", "global"])
def test_rejected_tokens_are_never_chosen_yet_count_in_the_quota_and_the_centring(scope):
    # The sequence holding the largest covariance is rejected: KL-Cov must take the top K of the other sequences'
    # tokens, K and the covariance still counted over all 53 tokens (they stay in the loss normaliser).
    seqs = make_seqs()
    rejected = {top_sequence(seqs)}
    cov, _ = ref_cov(seqs)
    k = max(1, math.floor(KL_RATIO * len(cov)))
    kept = {key: c for key, c in cov.items() if key[0] not in rejected}
    want = set(sorted(kept, key=kept.get, reverse=True)[:k])
    assert want != ref_kl_top(seqs, KL_RATIO)  # the rejection changes the choice
    want_cands = {key for key in ref_clip_candidates(seqs) if key[0] not in rejected}
    assert ref_clip_candidates(seqs) - want_cands  # a candidate of Clip-Cov sits in the rejected sequence
    kl, cc = KLCovConfig(ratio=KL_RATIO), ClipCovConfig(ratio=1.0, lb=CLIP_COV["cov_lb"], ub=CLIP_COV["cov_ub"])
    ctx = LossContext(clip_low=1.0, clip_high=1.0)
    if scope == "micro_batch":
        ids = list(range(8))
        batch = weighted(pad(seqs, ids), rejected, ids)
        got_kl = to_pairs([select_tokens("kl_cov", kl, None, batch, ctx)[0]], [ids])
        got_cc = to_pairs([select_tokens("clip_cov", cc, None, batch, ctx)[0]], [ids])
        # the plain functions choose the same way when they select for themselves
        args = (batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask)
        plain_kl = kl_cov_loss(*args, ratio=KL_RATIO, is_weights=batch.is_weights).selected
        plain_cc = clip_cov_loss(*args, **dict(CLIP_COV, ratio=1.0), is_weights=batch.is_weights).selected
        assert to_pairs([plain_kl], [ids]) == want and to_pairs([plain_cc], [ids]) == want_cands
    else:
        groups = split_ids([3, 5])
        batches = [weighted(pad(seqs, g), rejected, g) for g in groups]

        def pooled(name, params):
            def choose(tokens, means):
                return select_tokens(
                    name, params, None, tokens, LossContext(clip_low=1.0, clip_high=1.0, cov_means=means)
                )

            masks, means, _, _ = pooled_selection(batches, choose, with_weights=True)
            assert means == (pytest.approx(ref_cov(seqs)[1][0], rel=1e-6), pytest.approx(ref_cov(seqs)[1][1], rel=1e-6))
            return to_pairs(masks, groups)

        got_kl, got_cc = pooled("kl_cov", kl), pooled("clip_cov", cc)
    assert got_kl == want and len(got_kl) == k
    assert got_cc == want_cands  # ratio 1: every candidate outside the rejected sequence, none in it


def test_pooled_weights_absent_on_a_micro_batch_weigh_one():
    # global_selection's MicroBatch carries no weights: with_weights, it selects as if every token weighed 1
    seqs = make_seqs()
    groups = split_ids([4, 4])
    batches = [pad(seqs, g) for g in groups]

    def choose(tokens, means):
        return select_tokens("kl_cov", KLCovConfig(ratio=KL_RATIO), None, tokens, LossContext(cov_means=means))

    masks, _, total, _ = pooled_selection(batches, choose, with_weights=True)
    assert to_pairs(masks, groups) == ref_kl_top(seqs, KL_RATIO) and total == 5


# ---------------------------------------------------------------- the losses use a precomputed selection


def test_kl_cov_loss_uses_the_given_selection():
    seqs = make_seqs()
    mb = pad(seqs, list(range(8)))
    cov, _ = ref_cov(seqs)
    lowest = set(sorted(cov, key=cov.get)[:4])  # the opposite of what KL-Cov's own top-k picks
    given = torch.zeros_like(mb.mask, dtype=torch.bool)
    for i, t in lowest:
        given[i, t] = True
    given[5, 4] = True  # padding (sequence 5 has one token): must be ignored
    lp = mb.log_probs.clone().requires_grad_(True)
    coef = 0.7
    out = kl_cov_loss(lp, mb.old_log_probs, mb.advantages, mb.mask, ratio=KL_RATIO, coef=coef, selected=given)
    assert to_pairs([out.selected], [list(range(8))]) == lowest
    assert out.loss.item() == pytest.approx(ref_loss(seqs, "kl_cov", lowest, coef=coef), rel=1e-5)
    out.loss.backward()
    n = sum(LENGTHS)
    for i, t, lpv, old, a in ref_tokens(seqs):
        d = lpv - old
        want = (-a * math.exp(d) + (coef * math.copysign(1.0, d) if (i, t) in lowest else 0.0)) / n
        assert lp.grad[i, t].item() == pytest.approx(want, rel=1e-4, abs=1e-8)
    # an empty given selection is unclipped policy gradient, although the loss would select tokens itself
    none = kl_cov_loss(
        lp.detach(), mb.old_log_probs, mb.advantages, mb.mask, ratio=KL_RATIO, selected=torch.zeros_like(given)
    )
    assert not none.selected.any()
    assert none.loss.item() == pytest.approx(ref_loss(seqs, "kl_cov", set()), rel=1e-5)


def test_clip_cov_loss_uses_the_given_selection():
    seqs = make_seqs()
    mb = pad(seqs, list(range(8)))
    cands = ref_clip_candidates(seqs)
    chosen = {(i, t) for i, t, *_ in ref_tokens(seqs) if (i, t) not in cands and (i + t) % 3 == 0}
    assert len(chosen) >= 5
    given = torch.zeros_like(mb.mask, dtype=torch.bool)
    for i, t in chosen:
        given[i, t] = True
    given[2, 8] = True  # padding: ignored
    lp = mb.log_probs.clone().requires_grad_(True)
    # the generator would draw real candidates; it must not be used when a selection is given
    out = clip_cov_loss(
        lp, mb.old_log_probs, mb.advantages, mb.mask, generator=torch.Generator().manual_seed(0), selected=given,
        **CLIP_COV,
    )  # fmt: skip
    assert to_pairs([out.selected], [list(range(8))]) == chosen
    assert out.loss.item() == pytest.approx(ref_loss(seqs, "clip_cov", chosen), rel=1e-5)
    assert out.metrics["clip_cov_frac"] == pytest.approx(len(chosen) / sum(LENGTHS))
    out.loss.backward()
    for i, t in chosen:
        assert lp.grad[i, t].item() == 0.0
    assert all(lp.grad[i, t].item() != 0.0 for i, t, *_ in ref_tokens(seqs) if (i, t) not in chosen)


# ---------------------------------------------------------------- two data-parallel ranks (gloo, loopback)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_SPLITS = {0: [1, 3], 1: [2, 2]}  # rank 0 holds sequences 0-3, rank 1 sequences 4-7


def _dist_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        seqs = make_seqs()
        groups = split_ids(RANK_SPLITS[rank], start=4 * rank)
        mbs = [pad(seqs, g) for g in groups]
        local_tokens = torch.tensor([sum(float(mb.mask.sum()) for mb in mbs)])
        dist.all_reduce(local_tokens)
        normalizer = float(local_tokens)
        result = {"normalizer": normalizer}
        for method in ("kl_cov", "clip_cov"):
            kw = CLIP_COV if method == "clip_cov" else {"ratio": KL_RATIO}
            gen = torch.Generator().manual_seed(SEED) if method == "clip_cov" else None
            masks, means = global_selection(mbs, method, generator=gen, **kw)
            loss_fn = clip_cov_loss if method == "clip_cov" else kl_cov_loss
            loss, grads, cov_means = 0.0, {}, []
            for mb, sel, g in zip(mbs, masks, groups):
                lp = mb.log_probs.clone().requires_grad_(True)
                out = loss_fn(
                    lp, mb.old_log_probs, mb.advantages, mb.mask, selected=sel, cov_means=means,
                    normalizer=normalizer, dp_size=world, **kw,
                )  # fmt: skip
                out.loss.backward()
                loss += out.loss.item()
                for row, i in enumerate(g):
                    grads[i] = lp.grad[row, : len(seqs[i]["lp"])].clone()
                cov_means.append((out.metrics["cov_mean"], int(mb.mask.sum())))
            result[method] = {
                "pairs": to_pairs(masks, groups),
                "means": means,
                "loss": loss,
                "grads": grads,
                "cov_means": cov_means,
            }
        # a rank without valid tokens (rank 1 gets an empty micro-batch, rank 0 the whole mini-batch), then both
        empty = MicroBatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
        mine = [pad(seqs, list(range(8)))] if rank == 0 else [empty]
        masks, means = global_selection(mine, "kl_cov", ratio=KL_RATIO)
        result["lopsided"] = {"pairs": to_pairs(masks, [list(range(8))]), "means": means, "n": int(masks[0].sum())}
        masks, means = global_selection([empty], "clip_cov", generator=torch.Generator().manual_seed(0), **CLIP_COV)
        result["all_empty"] = {"n": int(masks[0].sum()), "means": means}
        result["comm_device"] = str(_comm_device())
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_select_and_lose_as_one_process(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_dist_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    seqs = make_seqs()
    n = sum(LENGTHS)
    assert ranks[0]["normalizer"] == ranks[1]["normalizer"] == n
    whole = pad(seqs, list(range(8)))
    _, (ma, ml) = ref_cov(seqs)
    for method in ("kl_cov", "clip_cov"):
        r0, r1 = ranks[0][method], ranks[1][method]
        # each rank selected only among its own sequences, and the union is the single-process selection
        assert all(i < 4 for i, _ in r0["pairs"]) and all(i >= 4 for i, _ in r1["pairs"])
        single, single_means = select(seqs, [8], method)
        assert r0["pairs"] | r1["pairs"] == single
        assert len(single) == 5
        assert r0["means"] == r1["means"] == single_means
        assert single_means == (pytest.approx(ma, rel=1e-6), pytest.approx(ml, rel=1e-6))
        if method == "kl_cov":
            assert single == ref_kl_top(seqs, KL_RATIO)
        else:
            assert single <= ref_clip_candidates(seqs)

        # losses with the global normaliser: each rank's share is scaled by dp_size, so their mean (what gradient
        # averaging across ranks optimises) is the single-process loss over the whole mini-batch
        kw = CLIP_COV if method == "clip_cov" else {"ratio": KL_RATIO}
        loss_fn = clip_cov_loss if method == "clip_cov" else kl_cov_loss
        sel = torch.zeros_like(whole.mask, dtype=torch.bool)
        for i, t in single:
            sel[i, t] = True
        lp = whole.log_probs.clone().requires_grad_(True)
        ref = loss_fn(lp, whole.old_log_probs, whole.advantages, whole.mask, selected=sel, **kw)
        ref.loss.backward()
        assert (r0["loss"] + r1["loss"]) / 2 == pytest.approx(ref.loss.item(), rel=1e-5)
        assert ref.loss.item() == pytest.approx(ref_loss(seqs, method, single), rel=1e-5)
        # and so is the averaged gradient: each token's gradient lives on one rank only
        for i, length in enumerate(LENGTHS):
            g = (r0 if i < 4 else r1)["grads"][i] / 2
            assert torch.allclose(g, lp.grad[i, :length], rtol=1e-5, atol=1e-9), (method, i)
        # the covariance metrics are centred on the global means (mean over each rank's tokens, independently)
        cov, _ = ref_cov(seqs)
        for r, rank_ids in ((r0, range(4)), (r1, range(4, 8))):
            vals = [cov[(i, t)] for i in rank_ids for t in range(LENGTHS[i])]
            weighted = sum(m * c for m, c in r["cov_means"]) / sum(c for _, c in r["cov_means"])
            assert weighted == pytest.approx(sum(vals) / len(vals), rel=1e-4, abs=1e-6)

    # lopsided: rank 1 holds nothing and selects nothing; rank 0 selects what one process would
    assert ranks[0]["lopsided"]["pairs"] == ref_kl_top(seqs, KL_RATIO)
    assert ranks[1]["lopsided"]["n"] == 0
    assert ranks[0]["lopsided"]["means"] == ranks[1]["lopsided"]["means"] == select(seqs, [8], "kl_cov")[1]
    # nothing valid on any rank: no selection, zero means, no hang or crash
    assert [r["all_empty"] for r in ranks] == [{"n": 0, "means": (0.0, 0.0)}] * 2
    assert [r["comm_device"] for r in ranks] == ["cpu", "cpu"]  # gloo gathers CPU tensors


def test_nccl_gathers_on_the_current_cuda_device(monkeypatch):
    # NCCL cannot move CPU tensors; the gather must stage them on this rank's GPU (no GPU here: only the choice)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _comm_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _comm_device() == torch.device("cpu")


def test_token_covariance_with_given_means_matches_reference():
    # the global means handed to the losses are used as is, not recomputed locally
    seqs = make_seqs()
    mb = pad(seqs, [0, 1, 2])
    cov, means = ref_cov(seqs)
    c = token_covariance(mb.log_probs, mb.advantages, mb.mask, means)
    for row, i in enumerate([0, 1, 2]):
        for t in range(LENGTHS[i]):
            assert c[row, t].item() == pytest.approx(cov[(i, t)], rel=1e-5, abs=1e-6)
    assert torch.isinf(c[~mb.mask.bool()]).all()


def test_std_unit_bounds_are_taken_over_the_pooled_tokens_whatever_the_split():
    """With --loss.clip_cov.bounds_unit std the band is lb..ub standard deviations of the covariances of every token
    pooled across the mini-batch: the same draw for every split, and for one micro-batch the loss's own."""
    seqs = make_seqs()
    std_units = {"bounds_unit": "std", "cov_lb": 0.5, "cov_ub": 3.0}
    results = [select(seqs, sizes, "clip_cov", **std_units)[0] for sizes in SPLITS]
    assert results[0] and all(r == results[0] for r in results[1:])
    assert results[0] != select(seqs, SPLITS[0], "clip_cov")[0]  # not the absolute band's choice
    mb = pad(seqs, list(range(8)))
    kw = {**CLIP_COV, **std_units}
    masks, _ = global_selection([mb], "clip_cov", generator=torch.Generator().manual_seed(SEED), **kw)
    own = clip_cov_loss(
        mb.log_probs, mb.old_log_probs, mb.advantages, mb.mask, generator=torch.Generator().manual_seed(SEED), **kw
    ).selected
    assert torch.equal(masks[0], own)
