"""study/entropy_curve.py on synthetic runs whose law and gap are known: the fits recover a and b, the gap of points
set above GRPO's curve is that offset, and the paired-seed bootstrap is the resampling redone here by hand (numpy
least squares on the law's linear form, the same generator draws)."""

import json
from pathlib import Path

import numpy as np
import pytest

from study import entropy_curve as ec

A, B = 0.2, 0.6


def law(h):
    return -A * np.exp(h) + B


def points(entropy: list[float], offset: float = 0.0, noise: np.ndarray | None = None) -> ec.Points:
    h = np.array(entropy)
    acc = law(h) + offset + (0.0 if noise is None else noise)
    return ec.Points(np.array([0, 13, 25]), h, acc)


def by_hand_fit(runs: list[ec.Points]) -> tuple[float, float]:
    """(a, b) by least squares on R = a (-exp H) + b, the law's linear form."""
    h = np.concatenate([r.entropy for r in runs])
    r = np.concatenate([r.acc for r in runs])
    (a, b), *_ = np.linalg.lstsq(np.column_stack([-np.exp(h), np.ones_like(h)]), r, rcond=None)
    return float(a), float(b)


def by_hand_gap(a: float, b: float, runs: list[ec.Points], final_only: bool = False) -> float:
    if final_only:
        return float(np.mean([r.acc[-1] - (-a * np.exp(r.entropy[-1]) + b) for r in runs]))
    res = [r.acc[i] - (-a * np.exp(r.entropy[i]) + b) for r in runs for i in range(len(r.version)) if r.version[i]]
    return float(np.mean(res))


def test_points_on_grpos_curve_give_no_gap_and_points_above_it_give_their_offset():
    grpo = {s: points([0.7, 0.3 + 0.02 * s, 0.1 + 0.01 * s]) for s in range(1, 8)}
    kl_on = {s: points([0.7, 0.6 - 0.01 * s, 0.4 + 0.02 * s]) for s in range(1, 8)}
    # the trained points set 0.05 above the curve (version 0, the shared start, stays on it)
    kl_above = {s: ec.Points(p.version, p.entropy, p.acc + np.array([0.0, 0.05, 0.05])) for s, p in kl_on.items()}
    on = ec.analyse(grpo, kl_on, resamples=200)
    fit, a, b, ceiling = on.fits["grpo"]
    assert (fit.a, fit.b, fit.ceiling) == pytest.approx((A, B, B - A), abs=1e-9)
    assert on.gap_all.value == pytest.approx(0.0, abs=1e-9) and on.gap_final.value == pytest.approx(0.0, abs=1e-9)
    assert on.gap_all.low == pytest.approx(0.0, abs=1e-9) and on.gap_all.high == pytest.approx(0.0, abs=1e-9)
    above = ec.analyse(grpo, kl_above, resamples=200)
    assert above.gap_all.value == pytest.approx(0.05, abs=1e-9)
    assert above.gap_final.value == pytest.approx(0.05, abs=1e-9)
    assert above.grpo_own == pytest.approx(0.0, abs=1e-9)
    assert above.finals["kl_cov"][0] == pytest.approx(np.mean([p.entropy[-1] for p in kl_on.values()]))


def test_the_gap_and_its_bootstrap_are_the_resampling_by_hand():
    rng = np.random.default_rng(5)
    grpo = {s: points([0.7, rng.uniform(0.2, 0.5), rng.uniform(0.05, 0.2)], noise=rng.normal(0, 0.03, 3))
            for s in range(1, 8)}  # fmt: skip
    kl = {s: points([0.7, rng.uniform(0.4, 0.7), rng.uniform(0.3, 0.6)], 0.02, rng.normal(0, 0.03, 3))
          for s in range(1, 8)}  # fmt: skip
    resamples, seed = 300, 4
    got = ec.analyse(grpo, kl, resamples=resamples, seed=seed)
    a, b = by_hand_fit(list(grpo.values()))
    assert got.fits["grpo"][0].a == pytest.approx(a, abs=1e-7) and got.fits["grpo"][0].b == pytest.approx(b, abs=1e-7)
    assert got.gap_all.value == pytest.approx(by_hand_gap(a, b, list(kl.values())), abs=1e-7)
    assert got.gap_final.value == pytest.approx(by_hand_gap(a, b, list(kl.values()), final_only=True), abs=1e-7)
    # the same seeds picked for both arms, GRPO refitted on its picked runs, the gap on KL-Cov's picked runs
    draws, finals, kl_a = [], [], []
    r = np.random.default_rng(seed)
    for _ in range(resamples):
        picked = [sorted(grpo)[i] for i in r.integers(0, 7, size=7)]
        ga, gb = by_hand_fit([grpo[s] for s in picked])
        draws.append(by_hand_gap(ga, gb, [kl[s] for s in picked]))
        finals.append(by_hand_gap(ga, gb, [kl[s] for s in picked], final_only=True))
        kl_a.append(by_hand_fit([kl[s] for s in picked])[0])
    assert got.resamples == resamples
    assert (got.gap_all.low, got.gap_all.high) == pytest.approx(tuple(np.percentile(draws, [2.5, 97.5])), abs=1e-6)
    assert (got.gap_final.low, got.gap_final.high) == pytest.approx(tuple(np.percentile(finals, [2.5, 97.5])), abs=1e-6)
    assert (got.fits["kl_cov"][1].low, got.fits["kl_cov"][1].high) == pytest.approx(
        tuple(np.percentile(kl_a, [2.5, 97.5])), abs=1e-6
    )


def test_the_arms_must_share_their_seeds():
    with pytest.raises(ValueError, match="seeds differ"):
        ec.analyse({1: points([0.7, 0.3, 0.1])}, {2: points([0.7, 0.3, 0.1])})


def test_points_are_read_by_the_version_evaluated_and_version_0_can_be_the_base_models(tmp_path: Path):
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [{"step": s, "entropy/seq_mean": 0.8 - 0.01 * s} for s in range(50)]
    rows[25].update({"eval/policy_version": 25, "eval/acc": 0.3})
    rows[49].update({"eval/policy_version": 50, "eval/acc": 0.4})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = ec.read_points(folder, "eval/acc", base={"eval/acc": 0.2})
    assert p.version.tolist() == [0, 25, 50]
    assert p.entropy.tolist() == pytest.approx([0.8, 0.55, 0.31]) and p.acc.tolist() == [0.2, 0.3, 0.4]
    assert ec.read_points(folder, "eval/acc").version.tolist() == [25, 50]
    with pytest.raises(ValueError, match="base model"):
        ec.read_points(folder, "eval/acc", base={"eval/pass@1": 0.1})
