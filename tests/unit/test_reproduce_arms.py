"""Every arm of study/reproduce.sh is a config the pipeline accepts, and the documented arms mean what the docs say.

A misspelled flag in an arm would otherwise surface only when its run starts, possibly hours into a study. The script's
dry run (REPRO_DRY_RUN=1) prints each run's command; each is parsed and validated here as the pipeline would.
"""

import json
import os
import re
import subprocess
import warnings
from collections import Counter
from pathlib import Path

import pytest

from entropy_openrlhf.config import Config, from_args, validate
from entropy_openrlhf.data.arith_task import generate
from entropy_openrlhf.presets import PIPELINES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "study" / "reproduce.sh"


def declared_arms() -> set[str]:
    """The keys of the script's PIPELINE and EXTRA tables: the arms that are not a pipeline of their own."""
    text = SCRIPT.read_text()
    arms: set[str] = set()
    for table in ("PIPELINE", "EXTRA"):
        block = re.search(rf"declare -A {table}=\((.*?)\)\n", text, re.S)
        assert block, f"{SCRIPT}: no `declare -A {table}=(...)` table"
        arms |= set(re.findall(r"\[(\w+)\]=", block.group(1)))
    return arms


def dry_run(tmp_path: Path, methods: list[str], *args: str) -> dict[str, list[str]]:
    """{run: argv of its command} as the script prints them, without running or writing anything."""
    env = {
        **os.environ,
        "REPRO_DRY_RUN": "1",
        "REPRO_OUT": str(tmp_path / "out"),
        "REPRO_STUDY": str(tmp_path / "plots"),  # empty: no committed run is skipped
        "METHODS": " ".join(methods),
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "out").exists(), "a dry run wrote its output folder"
    commands = {}
    for line in done.stdout.splitlines():
        run, _, command = line.removeprefix("== ").partition(": ")
        commands[run] = command.split()
    # the exploration's arms first evaluate the base model once (explore_base), then run their seeds
    base = any(m.startswith("explore_") for m in methods)
    assert len(commands) == len(methods) + base, done.stdout
    return commands


def accepted(argv: list[str]) -> Config:
    """The config the pipeline would build from a printed command; ConfigError if it would refuse it."""
    assert argv[0] == ".venv/bin/python", argv
    pipeline = Path(argv[1]).stem
    assert pipeline in PIPELINES, f"{argv[1]}: no such pipeline"
    cfg = from_args(argv[2:], PIPELINES[pipeline])
    with warnings.catch_warnings():  # legal but wasted settings warn (clip_cov_global's scope does); refusals raise
        warnings.simplefilter("ignore")
        validate(cfg)
    return cfg


def test_every_study_arm_is_a_config_the_pipeline_accepts(tmp_path):
    arms = sorted(declared_arms() | {"grpo", "clip_cov", "kl_cov", "clip_higher"})
    commands = dry_run(tmp_path, arms, "--seeds", "2-2")
    assert set(commands) == {f"{arm}_seed2" for arm in arms} | {"explore_base"}
    for run, argv in commands.items():
        if run == "explore_base":
            continue  # scripts/evaluate.py, not a pipeline: test_the_exploration_arms_are_as_fixed_in_advance
        cfg = accepted(argv)
        assert cfg.train.seed == 2, run  # the study's seed comes after COMMON's seed 1
        if not run.startswith("explore_"):
            assert cfg.eval.n_samples == 16 and cfg.train.num_steps == 25, run


def test_single_seed_runs_take_the_callers_flags(tmp_path):
    commands = dry_run(tmp_path, ["grpo", "kl_cov_target"], "--train.num_steps", "3")
    assert set(commands) == {"grpo", "kl_cov_target"}
    for argv in commands.values():
        assert accepted(argv).train.num_steps == 3


def test_the_documented_clip_cov_arms_have_their_documented_settings(tmp_path):
    arms = ["clip_cov", "clip_cov_wide", "clip_cov_r03", "clip_cov_all"]
    commands = dry_run(tmp_path, arms, "--seeds", "1-1")
    losses = {arm: accepted(commands[f"{arm}_seed1"]).loss for arm in arms}
    settings = {arm: (loss.clip_cov.ratio, loss.clip_cov.lb, loss.clip_cov.bounds_unit) for arm, loss in losses.items()}
    # the first small-scale setting, the preset, and the preset with 30% and with every candidate
    # (docs/algorithms/losses.md)
    assert settings == {
        "clip_cov": (0.05, 1.0, "std"),
        "clip_cov_wide": (0.1, 0.5, "std"),
        "clip_cov_r03": (0.3, 0.5, "std"),
        "clip_cov_all": (1.0, 0.5, "std"),
    }
    for arm, loss in losses.items():  # the paper's PPO clip for Clip-Cov, in every arm
        assert (loss.type, loss.clip_low, loss.clip_high) == ("clip_cov", 1.0, 1.0), arm


@pytest.mark.parametrize("bad", ["--seeds x", "--seeds 3-"])
def test_a_malformed_seed_range_is_refused_by_name(tmp_path, bad):
    done = subprocess.run(
        ["bash", str(SCRIPT), *bad.split()],
        env={**os.environ, "REPRO_DRY_RUN": "1", "REPRO_OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and f"--seeds {bad.split()[1]}" in done.stderr


def test_the_study_table_lists_every_committed_arm_the_baseline_first(tmp_path):
    # Nothing runs: every run asked for has committed metrics (here, copies of real ones), so the script goes straight
    # to its table. kl_cov_target is declared but not in STUDY_ORDER: it must still be listed, after the ordered arms.
    plots = tmp_path / "plots"
    for arm, source in [("kl_cov_target", "kl_cov"), ("clip_cov_wide", "clip_cov_wide"), ("grpo", "grpo")]:
        for seed in (2, 3):
            run = plots / "runs" / f"{arm}_seed{seed}"
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text(
                (ROOT / "study" / "runs" / f"{source}_seed{seed}" / "metrics.jsonl").read_text()
            )
    env = {
        **os.environ,
        "REPRO_OUT": str(tmp_path / "out"),
        "REPRO_STUDY": str(plots),
        "METHODS": "grpo kl_cov_target",
        "MPLBACKEND": "Agg",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--seeds", "2-3"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped" in done.stdout and not list((tmp_path / "out").glob("*.log")), "a run was started"
    table = (tmp_path / "out" / "results_study.txt").read_text()
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "seeds" not in line]
    arms = [row for row in dict.fromkeys(rows) if row in {"grpo", "clip_cov_wide", "kl_cov_target"}]
    assert arms == ["grpo", "clip_cov_wide", "kl_cov_target"], table


def test_the_exploration_arms_are_as_fixed_in_advance(tmp_path):
    # study/notebook.md, "The exploration experiment": fixed before its first run
    commands = dry_run(tmp_path, ["explore_grpo", "explore_kl_cov"], "--seeds", "3-3")
    heldout = "study/runs/explore_base/heldout.jsonl"
    for arm, loss_type in [("explore_grpo", "ppo"), ("explore_kl_cov", "kl_cov")]:
        cfg = accepted(commands[f"{arm}_seed3"])
        assert cfg.loss.type == loss_type and cfg.train.seed == 3
        assert cfg.data.levels() == (3, 4) and cfg.data.test == heldout
        assert (cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.num_steps) == (4, 8, 50)
        assert (cfg.train.mini_batches, cfg.async_.max_staleness) == (4, 1)  # the study's
        assert (cfg.eval.n_samples, cfg.eval.temperature, cfg.eval.max_samples) == (64, 1.0, 0)
        assert (cfg.eval.every, cfg.eval.initial) == (25, False)
    base = commands["explore_base"]
    assert base[1] == "scripts/evaluate.py"
    flags = dict(zip(base[2::2], base[3::2]))
    assert flags["--data.test"] == heldout and flags["--eval.n_samples"] == "64"
    assert flags["--eval.temperature"] == "1.0" and flags["--eval.max_samples"] == "0"


ASYNC_ARMS = ["async_grpo_sync", "async_kl_cov_sync", "async_grpo_partial", "async_kl_cov_partial"]
# what a schedule sets; everything else of an asynchrony arm is the seven-seed study's arm of the same objective
SCHEDULE_KEYS = {"rollout.mode", "async.max_staleness", "rollout.partial_kv", "train.output_dir", "logger.run_name"}


def test_the_asynchrony_arms_are_the_seven_seed_arms_under_their_schedules(tmp_path):
    # study/notebook.md, "KL-Cov under asynchrony, fixed in advance": fixed before its first run
    commands = dry_run(tmp_path, ["grpo", "kl_cov", *ASYNC_ARMS], "--seeds", "4-4")
    study = {arm: accepted(commands[f"{arm}_seed4"]) for arm in ("grpo", "kl_cov")}
    assert (study["grpo"].rollout.mode, study["grpo"].async_.max_staleness) == ("batch", 1)  # one step off
    schedules = {"sync": ("batch", 0), "partial": ("partial", 2)}
    for arm in ASYNC_ARMS:
        _, objective, schedule = re.fullmatch(r"(async)_(\w+)_(sync|partial)", arm).groups()
        cfg = accepted(commands[f"{arm}_seed4"])
        assert (cfg.rollout.mode, cfg.async_.max_staleness) == schedules[schedule], arm
        assert cfg.rollout.partial_kv == "keep", arm
        assert (cfg.train.seed, cfg.train.num_steps, cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt) == (
            4, 25, 4, 4,
        ), arm  # fmt: skip
        mine, theirs = cfg.flatten(), study[objective].flatten()
        differ = {key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key)}
        assert differ <= SCHEDULE_KEYS, (arm, {key: (mine.get(key), theirs.get(key)) for key in differ})
        if objective == "kl_cov":
            assert (cfg.loss.type, cfg.loss.kl_cov.ratio, cfg.loss.kl_cov.coef) == ("kl_cov", 2e-3, 1.0), arm
        else:
            assert (cfg.loss.type, cfg.loss.clip_low, cfg.loss.clip_high) == ("ppo", 0.2, 0.2), arm
        # the correction each schedule comes with by default: none when synchronous, truncated IS when not
        assert cfg.is_async == (schedule == "partial"), arm


def test_methods_async_runs_the_four_arms_seed_by_seed_never_resumed_and_skips_committed_runs(tmp_path):
    out, plots = tmp_path / "out", tmp_path / "plots"
    for run in ("async_grpo_partial_seed1", "grpo_seed1"):  # both stopped part-way, with a checkpoint
        (out / run / "checkpoints" / "step5").mkdir(parents=True)
    (plots / "runs" / "async_kl_cov_sync_seed2").mkdir(parents=True)  # committed by an earlier sitting
    (plots / "runs" / "async_kl_cov_sync_seed2" / "metrics.jsonl").write_text("{}\n")
    env = {**os.environ, "REPRO_DRY_RUN": "1", "REPRO_OUT": str(out), "REPRO_STUDY": str(plots)}
    done = subprocess.run(["bash", str(SCRIPT), "--seeds", "2"], env={**env, "METHODS": "grpo async"},
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    runs = [line.removeprefix("== ").split(":")[0] for line in lines]
    assert runs == [
        "grpo_seed1", "async_grpo_sync_seed1", "async_kl_cov_sync_seed1", "async_grpo_partial_seed1",
        "async_grpo_partial_seed1", "async_kl_cov_partial_seed1",
        "grpo_seed2", "async_grpo_sync_seed2", "async_kl_cov_sync_seed2", "async_grpo_partial_seed2",
        "async_kl_cov_partial_seed2",
    ]  # fmt: skip
    by_run = {}
    for line in lines:
        by_run.setdefault(line.removeprefix("== ").split(":")[0], []).append(line)
    assert "--train.resume true" in by_run["grpo_seed1"][0]  # a study run continues from its checkpoint
    stopped, command = by_run["async_grpo_partial_seed1"]
    assert "start again from step 0" in stopped and "--train.resume" not in command
    assert by_run["async_kl_cov_sync_seed2"] == [
        f"== async_kl_cov_sync_seed2: its metrics are in {plots}/runs/async_kl_cov_sync_seed2, skipped"
    ]


def test_the_exploration_heldout_set_is_the_generators_and_never_trained_on():
    # one fixed set for every run: 48 test-split problems of level 3 and 48 of level 4, disjoint from any train split
    rows = [json.loads(line) for line in (ROOT / "study/runs/explore_base/heldout.jsonl").read_text().splitlines()]
    assert rows == generate(96, split="test", seed=0, levels=(3, 4))
    assert Counter(r["level"] for r in rows) == {3: 48, 4: 48}
    questions = {r["prompt"][-1]["content"] for r in rows}
    assert len(questions) == 96
    for seed in range(1, 8):
        train = generate(2000, split="train", seed=seed, levels=(3, 4))
        assert not questions & {r["prompt"][-1]["content"] for r in train}


def test_merged_metrics_keep_the_newest_row_of_each_step_and_an_older_evaluation_s_own_row(tmp_path):
    """merge_metrics joins the W&B folders (one per resume) of a run from before metrics.jsonl moved to the output
    folder: a step logged again replaces the earlier row, and a row holding only an older evaluation (two finished
    in one step) stays, before its step's training row."""
    rows = {
        "offline-run-1": [{"step": 0, "loss/policy": 1.0}, {"step": 1, "loss/policy": 1.0},
                          {"step": 2, "eval/policy_version": 2, "eval/acc": 0.1},
                          {"step": 2, "loss/policy": 1.0, "eval/policy_version": 3}],
        "offline-run-2": [{"step": 1, "loss/policy": 2.0}],  # step 1 again, after a resume
    }  # fmt: skip
    for folder, lines in rows.items():
        files = tmp_path / "wandb" / folder / "files"
        files.mkdir(parents=True)
        (files / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    function = re.search(r"^merge_metrics\(\) \{.*?^\}$", SCRIPT.read_text(), re.S | re.M).group(0)
    out = tmp_path / "merged.jsonl"
    subprocess.run(["bash", "-c", f'{function}\nmerge_metrics "$1" "$2"', "_", str(tmp_path), str(out)], cwd=ROOT,
                   check=True, timeout=120)  # fmt: skip
    merged = [json.loads(line) for line in out.read_text().splitlines()]
    assert merged == [rows["offline-run-1"][0], rows["offline-run-2"][0], *rows["offline-run-1"][2:]]


def test_merged_metrics_of_a_run_are_its_output_folder_s_metrics_jsonl(tmp_path):
    """A run's metrics.jsonl in its output folder (where the tracker writes it, a resume's rows included) is what
    merge_metrics keeps; W&B folders beside it (which no longer hold metrics) are not read."""
    lines = [{"step": 0, "loss/policy": 1.0}, {"step": 1, "eval/policy_version": 1, "eval/acc": 0.1},
             {"step": 1, "loss/policy": 2.0, "eval/policy_version": 2}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    old = tmp_path / "wandb" / "offline-run-1" / "files"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss/policy": 9.0}) + "\n")
    function = re.search(r"^merge_metrics\(\) \{.*?^\}$", SCRIPT.read_text(), re.S | re.M).group(0)
    out = tmp_path / "merged.jsonl"
    subprocess.run(["bash", "-c", f'{function}\nmerge_metrics "$1" "$2"', "_", str(tmp_path), str(out)], cwd=ROOT,
                   check=True, timeout=120)  # fmt: skip
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines
