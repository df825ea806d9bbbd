"""study/explore.py, the exploration experiment's analysis fixed before its runs, on synthetic runs whose answers
are computed here independently (scipy's one-sample t and binomial tests, Holm by hand)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from study import explore

KS = (1, 2, 4, 8, 16, 32, 64)


def write_run(folder: Path, entropy: list[float], final: dict[int, float], midway: dict[int, float] | None) -> None:
    """50 training steps (rows 0-49) as the trainer logs them: the evaluation of policy version 25 in the row of step
    25, that of the final weights (version 50) in the last row, step 49."""
    folder.mkdir(parents=True)
    rows = [{"step": s, "entropy/seq_mean": h, "reward/acc": 0.1} for s, h in enumerate(entropy)]
    if midway is not None:
        rows[25].update({"eval/policy_version": 25, **{f"eval/pass@{k}": v for k, v in midway.items()}})
    if final is not None:
        rows[49].update({"eval/policy_version": 50, **{f"eval/pass@{k}": v for k, v in final.items()}})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def curve(k_scale: float) -> dict[int, float]:
    return {k: min(1.0, k_scale * math.log2(2 * k) / 7) for k in KS}


@pytest.fixture
def experiment(tmp_path: Path) -> dict:
    rng = np.random.default_rng(3)
    names = ("grpo32", "kl32", "grpo_h", "kl_h", "kl1", "grpo1", "kl64", "grpo64", "grpo32_mid", "kl32_mid")
    truth: dict[str, list[float]] = {name: [] for name in names}
    for seed in range(1, 8):
        g, k = 0.5 + 0.05 * rng.standard_normal(), 0.5 + 0.05 * rng.standard_normal() + 0.04
        g_h, k_h = 0.3 + 0.02 * seed, 0.6 + 0.03 * rng.standard_normal()
        g_curve, k_curve = curve(g), curve(k)
        g_mid, k_mid = curve(0.9 * g), curve(0.8 * k)
        write_run(tmp_path / f"explore_grpo_seed{seed}", [1.0] * 40 + [g_h] * 10, g_curve, g_mid)
        write_run(tmp_path / f"explore_kl_cov_seed{seed}", [1.0] * 40 + [k_h] * 10, k_curve, k_mid)
        truth["grpo32_mid"].append(g_mid[32]), truth["kl32_mid"].append(k_mid[32])
        truth["grpo32"].append(g_curve[32]), truth["kl32"].append(k_curve[32])
        truth["grpo1"].append(g_curve[1]), truth["kl1"].append(k_curve[1])
        truth["grpo64"].append(g_curve[64]), truth["kl64"].append(k_curve[64])
        truth["grpo_h"].append(g_h), truth["kl_h"].append(k_h)
    write_run(tmp_path / "explore_grpo_seed8", [1.0] * 50, curve(0.5), curve(0.5))  # no KL-Cov partner: left out
    (tmp_path / "explore_base").mkdir()
    base = {f"eval/pass@{k}": v for k, v in curve(0.45).items()}
    (tmp_path / "explore_base" / "metrics.json").write_text(json.dumps({**base, "eval/acc": 0.1}))
    return {"dir": tmp_path, "base": curve(0.45), **{k: np.array(v) for k, v in truth.items()}}


def test_the_primary_endpoint_is_the_paired_pass32_difference_with_t_and_sign_tests(experiment):
    pairs = explore.find_pairs(experiment["dir"])
    assert list(pairs) == [1, 2, 3, 4, 5, 6, 7]  # seed 8 has one arm only
    a = explore.analyse(pairs, explore.read_base(experiment["dir"] / "explore_base" / "metrics.json"))
    d = experiment["kl32"] - experiment["grpo32"]
    assert a.primary.estimate.mean == pytest.approx(d.mean())
    half = stats.t.ppf(0.975, 6) * d.std(ddof=1) / math.sqrt(7)
    assert a.primary.estimate.low == pytest.approx(d.mean() - half)
    assert a.primary.estimate.high == pytest.approx(d.mean() + half)
    assert a.primary.t_p == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    above = int(np.sum(d > 0))
    assert a.primary.sign_p == pytest.approx(stats.binomtest(above, 7, 0.5).pvalue)


def test_the_secondary_family_is_holm_corrected_over_its_five_tests(experiment):
    a = explore.analyse(explore.find_pairs(experiment["dir"]),
                        explore.read_base(experiment["dir"] / "explore_base" / "metrics.json"))  # fmt: skip
    base32 = experiment["base"][32]
    expected = [
        experiment["grpo32"] - base32,  # one-sample against the base model's single number
        experiment["kl32"] - base32,
        experiment["kl1"] - experiment["grpo1"],
        experiment["kl64"] - experiment["grpo64"],
        np.log(experiment["kl_h"]) - np.log(experiment["grpo_h"]),  # entropy over the last ten steps
    ]
    p = [stats.ttest_1samp(d, 0).pvalue for d in expected]
    for t, d, want in zip(a.secondary, expected, p):
        assert t.estimate.mean == pytest.approx(d.mean())
        assert t.t_p == pytest.approx(want)
    order = np.argsort(p)
    by_hand = [0.0] * 5
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (5 - rank) * p[i]))
        by_hand[i] = running
    assert a.holm_p == pytest.approx(by_hand)


def test_the_midway_evaluation_is_described_from_step_25(experiment):
    a = explore.analyse(explore.find_pairs(experiment["dir"]),
                        explore.read_base(experiment["dir"] / "explore_base" / "metrics.json"))  # fmt: skip
    name, grpo, kl, diff = next(m for m in a.midway if m[0] == "pass@32")
    assert grpo.mean == pytest.approx(experiment["grpo32_mid"].mean())
    assert kl.mean == pytest.approx(experiment["kl32_mid"].mean())
    assert diff.mean == pytest.approx((experiment["kl32_mid"] - experiment["grpo32_mid"]).mean())


def test_the_final_weights_are_described_beside_the_tests_and_the_report_gives_the_counts(experiment, capsys):
    a = explore.analyse(explore.find_pairs(experiment["dir"]),
                        explore.read_base(experiment["dir"] / "explore_base" / "metrics.json"))  # fmt: skip
    final = {d.name: d for d in a.final}
    assert list(final) == ["pass@1", "pass@32", "pass@64"]
    for k in (1, 64):
        assert final[f"pass@{k}"].grpo.mean == pytest.approx(experiment[f"grpo{k}"].mean())
        assert final[f"pass@{k}"].kl_cov.mean == pytest.approx(experiment[f"kl{k}"].mean())
    assert final["pass@32"].difference.mean == pytest.approx(a.primary.estimate.mean)
    assert explore.main(["--runs", str(experiment["dir"])]) == 0
    out = capsys.readouterr().out
    d = experiment["kl32"] - experiment["grpo32"]
    assert f"({int(np.sum(d > 0))} of 7 pairs above 0; SD of the differences {d.std(ddof=1):.3f}," in out
    entropy = np.log(experiment["kl_h"]) - np.log(experiment["grpo_h"])
    assert f"({int(np.sum(entropy > 0))} of 7 above 0)" in out.split("last 10 steps:")[1].splitlines()[0]
    assert "Final weights, described, not tested" in out and "Midway (step 25), described, not tested" in out


def test_the_report_marks_fewer_pairs_than_planned_as_preliminary(experiment, capsys):
    for seed in (6, 7):
        (experiment["dir"] / f"explore_kl_cov_seed{seed}" / "metrics.jsonl").unlink()
    assert explore.main(["--runs", str(experiment["dir"])]) == 2  # nothing until all seven are in, unless asked
    assert "5 of the 7 pairs are in; the design reports nothing until all are" in capsys.readouterr().err
    assert explore.main(["--runs", str(experiment["dir"]), "--interim"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PRELIMINARY: 5 of the 7 planned pairs (seeds [1, 2, 3, 4, 5])")
    assert "Holm p" in out and "sign p" in out


def test_missing_base_or_pass_at_k_is_one_clear_error(experiment, capsys):
    (experiment["dir"] / "explore_base" / "metrics.json").unlink()
    assert explore.main(["--runs", str(experiment["dir"])]) == 2
    assert "explore_base/metrics.json: the base model's evaluation is missing" in capsys.readouterr().err
    folder = experiment["dir"] / "explore_base"
    folder.joinpath("metrics.json").write_text(json.dumps({"eval/pass@32": 0.4, "eval/pass@64": 0.5}))
    assert explore.main(["--runs", str(experiment["dir"])]) == 2
    assert "the base model's evaluation has no pass@1" in capsys.readouterr().err


def test_the_figure_draws_each_arms_final_and_midway_pass_at_k_over_the_pairs(experiment, capsys):
    pairs = explore.find_pairs(experiment["dir"])
    curves = explore.pass_at_k_by_arm(pairs, list(KS))
    assert set(curves) == {"explore_grpo", "explore_kl_cov"}
    assert set(curves["explore_grpo"]) == {"final", "step 25"}
    final32 = dict(curves["explore_kl_cov"]["final"])[32]
    assert final32.mean == pytest.approx(experiment["kl32"].mean())
    half = stats.t.ppf(0.975, 6) * experiment["kl32"].std(ddof=1) / math.sqrt(7)
    assert final32.high - final32.low == pytest.approx(2 * half)  # within [0, 1]: not cut
    assert dict(curves["explore_grpo"]["step 25"])[32].mean == pytest.approx(experiment["grpo32_mid"].mean())
    assert [k for k, _ in curves["explore_grpo"]["final"]] == list(KS)

    figure = experiment["dir"] / "figures" / "explore.png"
    assert explore.main(["--runs", str(experiment["dir"]), "--figure", str(figure)]) == 0
    assert f"wrote {figure}" in capsys.readouterr().out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def rewrite(folder: Path, keep_final: bool = True, keep_midway: bool = True) -> None:
    """A run of the experiment with one of its two evaluations taken out."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if (row.get("eval/policy_version") == 50 and not keep_final) or (
            row.get("eval/policy_version") == 25 and not keep_midway
        ):
            for key in [key for key in row if key.startswith("eval/")]:
                del row[key]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_run_whose_final_weights_were_not_evaluated_is_an_error_not_its_midway_value(experiment, capsys):
    rewrite(experiment["dir"] / "explore_kl_cov_seed4", keep_final=False)  # its last evaluation is the step-25 one
    assert explore.main(["--runs", str(experiment["dir"])]) == 2
    err = capsys.readouterr().err
    assert "explore_kl_cov_seed4: no eval/pass@32 of the final weights (eval/policy_version 50); evaluated: [25]" in err


def test_a_run_with_a_step_logged_twice_or_missing_is_an_error(experiment, capsys):
    path = experiment["dir"] / "explore_grpo_seed2" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:30] + lines[29:]) + "\n")  # step 29 twice, as a careless resume would log it
    assert explore.main(["--runs", str(experiment["dir"])]) == 2
    assert "explore_grpo_seed2: entropy/seq_mean is not logged once at each step 0..49" in capsys.readouterr().err


def test_only_the_design_s_seeds_are_analysed(experiment, capsys):
    write_run(experiment["dir"] / "explore_kl_cov_seed8", [1.0] * 50, curve(0.5), curve(0.5))  # seed 8 now paired
    assert explore.main(["--runs", str(experiment["dir"])]) == 2
    assert "seed pair(s) [8] are not among the design's seeds [1, 2, 3, 4, 5, 6, 7]" in capsys.readouterr().err


def test_a_run_evaluated_once_has_no_midway_curve(experiment):
    rewrite(experiment["dir"] / "explore_grpo_seed3", keep_midway=False)
    curves = explore.pass_at_k_by_arm(explore.find_pairs(experiment["dir"]), list(KS))
    assert set(curves["explore_grpo"]) == {"final"}
    assert set(curves["explore_kl_cov"]) == {"final", "step 25"}


def timed(folder: Path, slow: dict[int, dict[str, float]]) -> None:
    """Give every row of a run the producer's and trainer's timings: generating and scoring a batch 20 s, a training
    step 55 s, except the keys given for the steps in `slow`."""
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.update({"time/sync": 1.0, "time/rollout": 15.0, "time/reward": 4.0, "time/train": 55.0})
        row.update(slow.get(row["step"], {}))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_race_check_names_a_step_whose_generation_outlasted_its_training(experiment, capsys):
    assert explore.main(["--runs", str(experiment["dir"])]) == 0
    assert "Evaluation-version check: no step at risk; no timings logged in" in capsys.readouterr().out
    timed(experiment["dir"] / "explore_kl_cov_seed3", {24: {"time/rollout": 40.0, "time/train": 30.0}})
    run = explore.find_pairs(experiment["dir"])[3]["explore_kl_cov"]
    # 1 + 40 + 4 = 45 s outlasts its 30 s training step; the step-25 batch (20 s) stays under that step's 30 s
    assert explore.steps_at_risk(run) == [24]
    assert explore.main(["--runs", str(experiment["dir"])]) == 0
    assert "steps at risk in {'explore_kl_cov_seed3': [24]}" in capsys.readouterr().out


def test_the_race_check_counts_the_sync_and_the_training_step_before(experiment):
    folder = experiment["dir"] / "explore_grpo_seed2"
    # the step-26 batch (the one the midway evaluation follows) runs beside training step 25: 10 + 30 + 10 = 50 s
    # outlasts its 45 s, though the training step of its own row (55 s) and its generation alone (30 s) do not
    timed(folder, {26: {"time/sync": 10.0, "time/rollout": 30.0, "time/reward": 10.0}, 25: {"time/train": 45.0}})
    assert explore.steps_at_risk(explore.find_pairs(experiment["dir"])[2]["explore_grpo"]) == [26]


def test_the_race_check_ignores_slow_steps_where_no_evaluation_is_due(experiment, capsys):
    # a slow batch at step 17 (as one run's was beside a test suite) or step 40 touches no evaluation
    slow = {"time/rollout": 80.0, "time/train": 20.0}
    timed(experiment["dir"] / "explore_grpo_seed3", {17: slow, 40: slow, 23: slow, 28: slow})
    assert explore.steps_at_risk(explore.find_pairs(experiment["dir"])[3]["explore_grpo"]) == []
    for seed in range(1, 8):
        for arm in explore.ARMS:
            timed(experiment["dir"] / f"{arm}_seed{seed}", {})
    assert explore.main(["--runs", str(experiment["dir"])]) == 0
    assert "Evaluation-version check: no step at risk in any of the 14 runs" in capsys.readouterr().out


def test_a_run_missing_a_timing_around_the_midway_evaluation_is_not_cleared(experiment):
    folder = experiment["dir"] / "explore_kl_cov_seed5"
    timed(folder, {})
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[26]["time/rollout"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert explore.steps_at_risk(explore.find_pairs(experiment["dir"])[5]["explore_kl_cov"]) == [26]


def test_the_race_check_counts_the_reference_and_flags_a_step_without_its_training_time(experiment):
    folder = experiment["dir"] / "explore_grpo_seed6"
    # step 25: 20 s of generation and scoring, plus 40 s of reference log-probs, outlasts the 55 s training steps
    timed(folder, {25: {"time/reference": 40.0}})
    assert explore.steps_at_risk(explore.find_pairs(experiment["dir"])[6]["explore_grpo"]) == [25]
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[25]["time/reference"], rows[26]["time/train"], rows[27]["time/train"]  # step 27: neither 26 nor 27
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert explore.steps_at_risk(explore.find_pairs(experiment["dir"])[6]["explore_grpo"]) == [27]
