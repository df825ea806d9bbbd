"""study/asynchrony.py, the asynchrony experiment's analysis fixed before its runs, on synthetic runs with planted
effects whose answers are computed here independently (scipy's one-sample t and binomial tests, Holm by hand), and
its power calculation against a simulation of the design."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from study import asynchrony as asy
from study.corrections import entropies, methods_of

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (1, 2, 3, 4, 5, 6)  # the new schedules' seeds in these tests (the design's are 1-27)


def write_run(
    folder: Path,
    entropy: float,
    acc: float,
    rate: float,
    staleness: int,
    per_step: list[dict] | None = None,
    streamed: bool = False,
) -> None:
    """25 training steps: entropy and train accuracy at `entropy` and `acc` over the last ten (other values before),
    `rate` samples/s at steps 1-24 (step 0 much slower, as a start-up is), staleness `staleness` after step 0."""
    folder.mkdir(parents=True)
    rows = []
    for s in range(25):
        late = s >= 15
        row = {
            "step": s,
            "entropy/seq_mean": entropy if late else 0.7,
            "reward/acc": acc if late else 0.05,
            "async/staleness_max": float(min(s, staleness)),
            "time/step": 60.0 + s,
            "throughput/samples_per_s": (rate if s else 0.01),
        }
        if streamed:
            row["async/token_staleness_mean"] = 0.5
            row["rollout/partial_frac"] = 0.25
            row["rollout/stale_kv_token_frac"] = 0.1
            row["rollout/dropped_stale_groups"] = float(s // 10)
        if per_step is not None:
            row.update(per_step[s])
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def selection_rows(excess: float, rng: np.random.Generator) -> list[dict]:
    """KL-Cov's per-step selection by age with a stale share `excess` above the stale tokens' share on average:
    ages 0, 1, 2; one step selects nothing (no selected_share), one has no age-2 tokens at all."""
    rows = []
    for s in range(25):
        share = np.array([0.5, 0.3, 0.2])
        if s == 7:
            share = np.array([0.6, 0.4, 0.0])
        jitter = 0.02 * rng.standard_normal()
        stale_selected = share[1:].sum() + excess + jitter
        selected = np.array([1 - stale_selected, stale_selected * 0.6, stale_selected * 0.4])
        if s == 7:
            selected = np.array([1 - stale_selected, stale_selected, 0.0])
        row = {f"offpolicy/staleness_{v}/token_frac": float(share[v]) for v in range(3) if s != 7 or v < 2}
        if s != 3:  # step 3 selected nothing: its selection is not logged, and it is left out
            row.update({f"cov/staleness_{v}/selected_share": float(selected[v]) for v in range(3) if s != 7 or v < 2})
        rows.append(row)
    return rows


def stale_excess_of(rows: list[dict]) -> float:
    """The run's mean over the steps that selected of (stale selected share - stale token share), by hand."""
    values = []
    for row in rows:
        if "cov/staleness_0/selected_share" not in row:
            continue
        sel = sum(row.get(f"cov/staleness_{v}/selected_share", 0.0) for v in (1, 2))
        share = sum(row.get(f"offpolicy/staleness_{v}/token_frac", 0.0) for v in (1, 2))
        values.append(sel - share)
    return float(np.mean(values))


def build(folder: Path, interaction: float, seed: int = 0, seeds=SEEDS) -> dict:
    """Every run of the design with KL-Cov's effect about 0.8 under synchronous training and `interaction` added
    under partial rollouts; returns the planted per-seed numbers."""
    rng = np.random.default_rng(seed)
    truth: dict[str, dict[int, float]] = {name: {} for name in (
        "e_sync", "e_one", "e_partial", "acc_sync", "acc_one", "acc_partial", "excess", "rate")}  # fmt: skip
    for s in sorted(set(seeds) | set(asy.ONE_STEP_SEEDS)):
        base = math.log(0.15 + 0.05 * rng.random())
        e_sync = 0.8 + 0.3 * rng.standard_normal()
        effects = {
            "sync": e_sync,
            "one_step": 0.8 + 0.3 * rng.standard_normal(),
            "partial": e_sync + interaction + 0.2 * rng.standard_normal(),
        }
        for schedule, e in effects.items():
            if schedule != "one_step" and s not in seeds:
                continue
            if schedule == "one_step" and s not in asy.ONE_STEP_SEEDS:
                continue
            acc_g = 0.35 + 0.05 * rng.standard_normal()
            acc_k = acc_g - {"sync": 0.10, "one_step": 0.03, "partial": 0.0}[schedule] + 0.03 * rng.standard_normal()
            rate_g = 0.25 * (1.5 if schedule == "partial" else 1.0) * math.exp(0.01 * rng.standard_normal())
            rate_k = 0.25 * (1.5 if schedule == "partial" else 1.0) * math.exp(0.01 * rng.standard_normal())
            streamed = schedule == "partial"
            rows = selection_rows(0.05 + 0.01 * s, rng) if streamed else None
            write_run(folder / asy.run_name("grpo", schedule, s), math.exp(base), acc_g, rate_g,
                      asy.MAX_STALENESS[schedule], streamed=streamed)  # fmt: skip
            write_run(folder / asy.run_name("kl_cov", schedule, s), math.exp(base + e), acc_k, rate_k,
                      asy.MAX_STALENESS[schedule], per_step=rows, streamed=streamed)  # fmt: skip
            key = {"sync": "sync", "one_step": "one", "partial": "partial"}[schedule]
            truth[f"e_{key}"][s] = e
            truth[f"acc_{key}"][s] = acc_k - acc_g
            if streamed:
                truth["excess"][s] = stale_excess_of(rows)
                truth["rate"][s] = rate_g * rate_k  # completed below with the sync rates
            elif schedule == "sync":
                truth.setdefault("rate_sync", {})[s] = rate_g * rate_k
    # ln(samples/s) partial - sync, the two arms averaged: half the log of the product ratio
    truth["rate"] = {s: 0.5 * math.log(truth["rate"][s] / truth["rate_sync"][s]) for s in seeds}
    return truth


@pytest.fixture
def small(monkeypatch):
    """The design with six new seeds instead of 27, for speed."""
    monkeypatch.setattr(asy, "NEW_SEEDS", SEEDS)
    monkeypatch.setattr(asy, "PAIRS_PLANNED", len(SEEDS))


def analysis(folder: Path):
    seeds = {"sync": asy.NEW_SEEDS, "one_step": asy.ONE_STEP_SEEDS, "partial": asy.NEW_SEEDS}
    return asy.analyse(asy.read_values(folder, seeds), planned=-0.3)


def arr(d: dict[int, float], seeds=SEEDS) -> np.ndarray:
    return np.array([d[s] for s in seeds])


def test_a_planted_interaction_is_recovered_with_its_t_interval_and_verdict(tmp_path, small, capsys):
    truth = build(tmp_path, interaction=-0.5)
    a = analysis(tmp_path)
    d = arr(truth["e_partial"]) - arr(truth["e_sync"])
    assert a.interaction.estimate.mean == pytest.approx(d.mean())
    half = stats.t.ppf(0.975, len(SEEDS) - 1) * d.std(ddof=1) / math.sqrt(len(SEEDS))
    assert (a.interaction.estimate.low, a.interaction.estimate.high) == pytest.approx(
        (d.mean() - half, d.mean() + half)
    )
    assert a.interaction.t_p == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    assert a.interaction.sign_p == pytest.approx(stats.binomtest(int((d > 0).sum()), len(d), 0.5).pvalue)
    assert a.interaction.estimate.high < 0
    assert asy.verdict(a.interaction).startswith("KL-Cov's entropy effect is smaller under partial rollouts")
    # its power at the planned interaction with the observed spread: the noncentral t's, computed here
    df, nc = len(d) - 1, 0.3 / d.std(ddof=1) * math.sqrt(len(d))
    crit = stats.t.ppf(0.975, df)
    assert a.interaction_power == pytest.approx(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
    assert asy.main(["--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "KL-Cov's entropy effect is smaller under partial rollouts than under synchronous training" in out
    assert "PRELIMINARY" not in out


def test_a_planted_null_is_not_called_smaller(tmp_path, small):
    build(tmp_path, interaction=0.0, seed=4)
    a = analysis(tmp_path)
    assert a.interaction.estimate.low < 0 < a.interaction.estimate.high
    assert (
        asy.verdict(a.interaction) == "a difference between the two schedules' effects is not shown in either direction"
    )


def test_a_larger_effect_under_partial_rollouts_is_said_so(tmp_path, small):
    build(tmp_path, interaction=+0.6)
    assert asy.verdict(analysis(tmp_path).interaction).startswith("KL-Cov's entropy effect is larger")


def test_each_schedule_s_primary_is_the_paired_log_ratio_over_the_last_ten_steps(tmp_path, small):
    truth = build(tmp_path, interaction=-0.5)
    a = analysis(tmp_path)
    for schedule, key, seeds in (("sync", "e_sync", SEEDS), ("one_step", "e_one", asy.ONE_STEP_SEEDS),
                                 ("partial", "e_partial", SEEDS)):  # fmt: skip
        e = arr(truth[key], seeds)
        t = a.primary[schedule]
        assert t.estimate.mean == pytest.approx(e.mean())
        assert t.t_p == pytest.approx(stats.ttest_1samp(e, 0).pvalue)
        assert a.seeds[schedule] == list(seeds)
    # described: the one-step-off pairs against the synchronous ones over the seeds both have
    one_minus_sync = a.described_interactions[0]
    assert one_minus_sync.estimate.mean == pytest.approx((arr(truth["e_one"]) - arr(truth["e_sync"])).mean())


def test_the_secondary_family_is_holm_corrected_over_its_five_tests(tmp_path, small):
    truth = build(tmp_path, interaction=-0.5)
    a = analysis(tmp_path)
    expected = [
        arr(truth["acc_sync"]),
        arr(truth["acc_one"], asy.ONE_STEP_SEEDS),
        arr(truth["acc_partial"]),
        arr(truth["excess"]),
        arr(truth["rate"]),
    ]
    p = [stats.ttest_1samp(d, 0).pvalue for d in expected]
    for t, d, want in zip(a.secondary, expected, p):
        assert t.estimate.mean == pytest.approx(d.mean(), abs=1e-9)
        assert t.t_p == pytest.approx(want)
    assert a.secondary[3].estimate.mean == pytest.approx(np.mean([0.05 + 0.01 * s for s in SEEDS]), abs=0.02)
    assert a.secondary[4].estimate.mean == pytest.approx(math.log(1.5), abs=0.03)  # partial's planted 1.5x
    # Holm by hand: sort, multiply the i-th smallest by m - i + 1, keep the running maximum, cap at 1
    order = np.argsort(p)
    by_hand, running = [0.0] * 5, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (5 - rank) * p[i]))
        by_hand[i] = running
    assert a.holm_p == pytest.approx(by_hand)
    assert sorted(range(5), key=lambda i: a.holm_p[i]) == sorted(range(5), key=lambda i: by_hand[i])


def test_samples_per_s_leaves_out_step_0_and_weighs_each_step_by_its_time(tmp_path):
    rows = [{"time/step": 100.0, "throughput/samples_per_s": 0.01}] + [
        {"time/step": 40.0 if s % 2 else 80.0, "throughput/samples_per_s": 0.4 if s % 2 else 0.2} for s in range(1, 25)
    ]
    write_run(tmp_path / "r", 0.2, 0.3, 0.0, 1, per_step=rows)
    # every step trains 16 responses (0.4 x 40 = 0.2 x 80): 24 x 16 over 12 x 40 + 12 x 80 seconds
    assert asy.samples_per_s(asy.Run(tmp_path / "r")) == pytest.approx(24 * 16 / (12 * 40 + 12 * 80))


def test_the_selection_by_age_counts_stale_tokens_against_their_share(tmp_path):
    rows = selection_rows(0.1, np.random.default_rng(1))
    write_run(tmp_path / "r", 0.2, 0.3, 0.3, 2, per_step=rows, streamed=True)
    excess, by_age = asy.selection_by_age(asy.Run(tmp_path / "r"))
    assert excess == pytest.approx(stale_excess_of(rows))
    steps = [r for r in rows if "cov/staleness_0/selected_share" in r]
    assert len(steps) == 24  # step 3 selected nothing
    assert by_age[2][1] == pytest.approx(np.mean([r.get("offpolicy/staleness_2/token_frac", 0.0) for r in steps]))
    assert sum(share for _, share in by_age.values()) == pytest.approx(1.0)


def test_missing_runs_are_one_clear_error_naming_them(tmp_path, small, capsys):
    build(tmp_path, interaction=-0.5)
    for run in ("async_kl_cov_partial_seed2", "async_kl_cov_partial_seed3", "async_kl_cov_partial_seed5",
                "async_grpo_sync_seed6", "kl_cov_seed4"):  # fmt: skip
        (tmp_path / run / "metrics.jsonl").unlink()
    assert asy.main(["--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the design's runs are not all in; missing: async_grpo_sync_seed{6}, kl_cov_seed{4}, " in err
    assert "async_kl_cov_partial_seed{2-3, 5}" in err


def test_interim_analyses_the_complete_seeds_marked_preliminary(tmp_path, small, capsys):
    build(tmp_path, interaction=-0.5)
    (tmp_path / "async_kl_cov_partial_seed6" / "metrics.jsonl").unlink()
    (tmp_path / "async_grpo_sync_seed5" / "metrics.jsonl").unlink()
    assert asy.main(["--runs", str(tmp_path), "--interim"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PRELIMINARY: 4 of the 6 planned pairs per new schedule (seeds 1-4)")
    assert "Holm p" in out and "synchronous seeds 1-4; one step off seeds 1-7; partial rollouts seeds 1-4" in out


def test_runs_outside_the_design_s_seeds_are_an_error(tmp_path, small, capsys):
    build(tmp_path, interaction=-0.5)
    write_run(tmp_path / "async_grpo_sync_seed9", 0.2, 0.3, 0.3, 0)
    assert asy.main(["--runs", str(tmp_path)]) == 2
    assert "runs outside the design's seeds 1-6: async_grpo_sync_seed9" in capsys.readouterr().err


@pytest.mark.parametrize(
    "run, change, message",
    [
        ("async_grpo_sync_seed2", {10: {"async/staleness_max": 1.0}},
         "staleness above 0 (the synchronous schedule's) at steps [10]"),
        ("async_kl_cov_partial_seed3", {12: {"async/staleness_max": 3.0}},
         "staleness above 2 (the partial rollouts schedule's) at steps [12]"),
        ("async_grpo_partial_seed1", {"drop": "async/token_staleness_mean"},
         "not a streamed run (async/token_staleness_mean not logged at every step)"),
        ("async_grpo_sync_seed4", {"repeat": 20}, "entropy/seq_mean is logged twice at some step"),
        ("async_kl_cov_sync_seed4", {"cut": 24}, "entropy/seq_mean is not logged once at each step 0..24"),
    ],
)  # fmt: skip
def test_a_run_whose_logs_contradict_its_schedule_is_an_error_naming_it(tmp_path, small, capsys, run, change, message):
    build(tmp_path, interaction=-0.5)
    path = tmp_path / run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if "drop" in change:
        for row in rows:
            row.pop(change["drop"])
    elif "repeat" in change:
        rows.insert(change["repeat"], dict(rows[change["repeat"]]))
    elif "cut" in change:
        rows = rows[: change["cut"]]
    else:
        for step, update in change.items():
            rows[step].update(update)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert asy.main(["--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert run in err and message in err


# ----------------------------------------------------------------------------------------------------- power


def simulated_power(effect: float, sd: float, rho: float, n: int, sims: int = 40_000, seed: int = 11) -> float:
    """The design simulated: each seed's effect under synchronous training ~ N(effect, sd), under partial rollouts
    ~ N(effect / 2, sd), correlated rho; the two-sided one-sample t-test of their differences at 0.05."""
    rng = np.random.default_rng(seed)
    cov = sd**2 * np.array([[1.0, rho], [rho, 1.0]])
    e = rng.multivariate_normal([effect, effect / 2], cov, size=(sims, n))
    d = e[..., 1] - e[..., 0]
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return float(np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1)))


@pytest.mark.parametrize("effect, sd, rho, n", [(0.638, 0.397, 0.0, 27), (0.638, 0.397, 0.5, 10), (0.88, 0.4, 0.0, 8)])
def test_the_interaction_power_matches_a_simulation_of_the_design(effect, sd, rho, n):
    assert asy.interaction_power(effect, sd, rho, n) == pytest.approx(simulated_power(effect, sd, rho, n), abs=0.01)


def test_pairs_needed_is_the_fewest_that_reach_80_percent_and_at_least_five():
    n = asy.pairs_needed(0.638, 0.397, 0.0)
    assert asy.interaction_power(0.638, 0.397, 0.0, n) >= 0.8 > asy.interaction_power(0.638, 0.397, 0.0, n - 1)
    assert asy.pairs_needed(5.0, 0.1, 0.0) == 5  # two pairs would do; the design asks for at least five
    m = asy.detectable(0.5, 20)
    assert asy.paired_t_power(m, 0.5, 20) == pytest.approx(0.8, abs=1e-6)


def test_the_planned_pairs_are_what_the_power_calculation_gives_from_the_committed_runs(capsys):
    effects = asy.committed_effects(ROOT / "study" / "runs")
    # the same per-seed log ratios the corrections print (study.corrections, item 2), read there another way
    grpo, kl = (entropies(m) for m in methods_of(ROOT / "study" / "runs", {"grpo": range(1, 8), "kl_cov": range(1, 8)}))
    assert effects == pytest.approx({s: math.log(kl[s] / grpo[s]) for s in range(1, 8)})
    p = asy.plan(effects)
    assert p.effect == pytest.approx(np.mean([effects[s] for s in (4, 5, 6, 7)]))
    assert p.sd == pytest.approx(np.std(list(effects.values()), ddof=1))
    assert p.pairs == asy.PAIRS_PLANNED == len(asy.NEW_SEEDS)
    assert asy.main(["--power"]) == 0
    out = capsys.readouterr().out
    assert f"Pairs per new schedule for 80% power: {asy.PAIRS_PLANNED} (at least 5)" in out
