"""The GPU preflight's report: each check passes on what a good run leaves and fails on what each fault leaves.
The runs are described by their logs and metrics (what the report reads); tests/e2e runs the real CPU twin."""

import json
from pathlib import Path

import pytest

from entropy_openrlhf.pipeline.gpu_preflight import (
    CHECKS,
    FAIL,
    INCONCLUSIVE,
    PASS,
    Check,
    Run,
    digit_share,
    exit_code,
    judge,
    load_run,
    main,
    report,
)


def good_log(run_dir: Path, backend: str = "nccl", resumed: bool = False) -> str:
    lines = [
        f"[entropy-openrlhf] kl_cov: model /m, 64 train / 0 test prompts; metrics {run_dir.parents[1]}/metrics.jsonl; "
        f"W&B run {run_dir}; TensorBoard {run_dir.parents[1]}/tensorboard",
        "[entropy-openrlhf] actors started in 40 s: rollout on 10.0.0.1; policy on 10.0.0.1, 10.0.0.1",
        f"[entropy-openrlhf] weight sync: collective over {backend}, 3 ranks",
    ]
    if resumed:
        lines.append("[entropy-openrlhf] resumed from /out/checkpoints/step2 at step 2")
    return "\n".join(lines)


def step(i: int, gap: float, **extra) -> dict:
    # a step moves log-probs by 0.1 (loss/ppo_kl), above the sync bound of a 0.03 floor: a stale engine would show
    return {"step": i, "rollout/logprob_diff_mean": gap, "time/sync": 0.0 if i == 0 else 1.5,
            "loss/policy": 0.1, "train/skipped_steps": 0.0, "train/grad_norm": 0.7, "loss/ppo_kl": 0.1,
            **extra}  # fmt: skip


def make_run(tmp_path: Path, name: str, metrics: list[dict], backend="nccl", resumed=False, code=0) -> Run:
    """A run in an output folder of its own, `tmp_path/name`: its rows in metrics.jsonl, a W&B folder with its run
    file, and the log that names that folder."""
    out = tmp_path / name
    run_dir = out / "wandb" / f"offline-run-{name}"
    run_dir.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / f"run-{name}.wandb").write_bytes(b"")
    return load_run(code, good_log(run_dir, backend, resumed), out)


# what Trainer.save leaves for two ZeRO-3 ranks (DeepSpeed's file names under the tag "state")
CHECKPOINT_FILES = (
    "trainer_state.json",
    "deepspeed/latest",
    "deepspeed/state/zero_pp_rank_0_mp_rank_00_model_states.pt",
    "deepspeed/state/zero_pp_rank_1_mp_rank_00_model_states.pt",
    "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "hf/config.json",
    "hf/model.safetensors",
    "hf/tokenizer_config.json",
)


@pytest.fixture
def out(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step2"
    for name in CHECKPOINT_FILES:
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_text("{}")
    return tmp_path


def verdicts(checks) -> dict[str, str]:
    assert [c.name for c in checks] == list(CHECKS)
    return {c.name: c.verdict for c in checks}


def good_runs(out: Path) -> tuple[Run, Run]:
    return make_run(out, "r1", [step(0, 0.030), step(1, 0.034)]), make_run(out, "r2", [step(2, 0.029)], resumed=True)


def test_a_good_gpu_run_passes_every_check(out):
    run1 = make_run(out, "r1", [step(0, 0.030), step(1, 0.034)])
    run2 = make_run(out, "r2", [step(2, 0.029)], resumed=True)
    checks = judge("gpu", run1, run2, out)
    assert set(verdicts(checks).values()) == {PASS} and exit_code(checks) == 0


def test_an_engine_that_kept_old_weights_fails_the_sync_check_only(out):
    run1 = make_run(out, "r1", [step(0, 0.030), step(1, 0.034)])
    run2 = make_run(out, "r2", [step(2, 0.075)], resumed=True)  # resumed engines never got the checkpoint
    result = verdicts(judge("gpu", run1, run2, out))
    assert result.pop("weight sync") == FAIL and set(result.values()) == {PASS}


def test_the_bound_is_twice_the_floor_plus_the_slack(out):
    run1 = make_run(out, "r1", [step(0, 1e-3), step(1, 2e-3 + 0.9e-5)])
    run2 = make_run(out, "r2", [step(2, 2e-3 + 1.1e-5)], resumed=True)
    sync = next(c for c in judge("gpu", run1, run2, out) if c.name == "weight sync")
    assert not sync.ok and "bound 0.002" in sync.detail


def test_a_sync_that_never_ran_fails(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03, **{"time/sync": 0.0})])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    assert verdicts(judge("gpu", run1, run2, out))["weight sync"] == FAIL


def test_a_step_too_small_to_tell_a_stale_engine_is_inconclusive_not_a_pass(out):
    # one step moves log-probs by 1e-4, far below the bound (0.06): a stale engine would pass too
    run1 = make_run(out, "r1", [step(0, 0.03, **{"loss/ppo_kl": 1e-4}), step(1, 0.03, **{"loss/ppo_kl": 1e-4})])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    checks = judge("gpu", run1, run2, out)
    result = verdicts(checks)
    assert result.pop("weight sync") == INCONCLUSIVE and set(result.values()) == {PASS}
    sync = next(c for c in checks if c.name == "weight sync")
    assert "a stale engine would go unseen" in sync.detail
    assert exit_code(checks) == 3  # not a pass, and nothing failed
    # ... but a gap beyond the bound still fails, whatever the step's size
    run2_stale = make_run(out, "r3", [step(2, 0.09)], resumed=True)
    assert verdicts(judge("gpu", run1, run2_stale, out))["weight sync"] == FAIL


def test_gloo_on_gpus_fails_the_group_check(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)], backend="gloo")
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    group = next(c for c in judge("gpu", run1, run2, out) if c.name == "sync group")
    assert not group.ok and "expected nccl" in group.detail
    assert verdicts(judge("cpu", run1, run2, out))["sync group"] == PASS


def test_skipped_or_non_finite_steps_fail_the_train_check(out):
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    skipped = make_run(out, "a", [step(0, 0.03), step(1, 0.03, **{"train/skipped_steps": 1.0})])
    nan = make_run(out, "b", [step(0, 0.03, **{"loss/policy": float("nan")}), step(1, 0.03)])
    for run1 in (skipped, nan):
        assert verdicts(judge("gpu", run1, run2, out))["train step"] == FAIL


def test_a_zero_gradient_makes_the_train_step_inconclusive(out):
    """Equal rewards in every group: zero advantages, zero gradient, no weight moved. The step ran without an
    error, but it cannot have shown that the update works."""
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03, **{"train/grad_norm": 0.0})])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    checks = judge("gpu", run1, run2, out)
    train = next(c for c in checks if c.name == "train step")
    assert train.verdict == INCONCLUSIVE and "zero gradient" in train.detail
    assert exit_code(checks) == 3


@pytest.mark.parametrize("lost", [name for name in CHECKPOINT_FILES if name != "deepspeed/latest"])
def test_a_checkpoint_without_any_of_its_parts_fails(out, lost):
    ckpt_dir = out / "checkpoints" / "step2"
    (ckpt_dir / lost).unlink()
    # every rank's file of a kind gone: the kind is missing (DeepSpeed writes one per rank)
    for other in ckpt_dir.glob(lost.replace("rank_0", "rank_*").replace("rank_1", "rank_*")):
        other.unlink()
    run1, run2 = good_runs(out)
    ckpt = next(c for c in judge("gpu", run1, run2, out) if c.name == "checkpoint")
    assert ckpt.verdict == FAIL, lost
    wanted = {"model_states": "deepspeed/state/*model_states.pt", "optim_states": "deepspeed/state/*optim_states.pt",
              "safetensors": "hf/*.safetensors"}  # fmt: skip
    assert next((w for k, w in wanted.items() if k in lost), lost) in ckpt.detail


def test_a_checkpoint_without_its_deepspeed_folder_fails(out):
    import shutil

    shutil.rmtree(out / "checkpoints" / "step2" / "deepspeed")
    run1, run2 = good_runs(out)
    ckpt = next(c for c in judge("gpu", run1, run2, out) if c.name == "checkpoint")
    assert ckpt.verdict == FAIL and "deepspeed/state/*model_states.pt" in ckpt.detail


@pytest.mark.parametrize(
    ("resumed", "steps", "code", "why"),
    [
        (False, [0, 1, 2], 0, "no 'resumed from"),  # started over
        (True, [2, 3], 0, "trained steps [2, 3], expected [2]"),  # resumed, then trained past the run's end
        (True, [3], 0, "trained steps [3], expected [2]"),  # skipped the checkpoint's step
        (True, [], 0, "trained steps [], expected [2]"),  # resumed and trained nothing
        (True, [2], 1, "exit code 1"),  # trained its step, then crashed
    ],
)
def test_the_resume_check_needs_the_resumed_line_the_step_and_a_clean_exit(out, resumed, steps, code, why):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)])
    run2 = make_run(out, "r2", [step(i, 0.03) for i in steps], resumed=resumed, code=code)
    resume = next(c for c in judge("gpu", run1, run2, out) if c.name == "resume")
    assert resume.verdict == FAIL and why in resume.detail, resume.detail


def test_a_run_that_failed_at_start_names_its_error(out):
    run1 = Run(2, "error: the run does not fit the Ray cluster: needs 4 GPUs, the cluster has 2 free: ...")
    checks = judge("gpu", run1, None, out)
    engine = checks[0]
    assert not engine.ok and engine.detail.startswith("error: the run does not fit")
    result = verdicts(checks)
    assert {v for k, v in result.items() if k != "checkpoint"} == {FAIL}  # the fixture's checkpoint is not run 1's


def test_a_missing_wandb_run_file_fails(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    next(run2.run_dir.glob("*.wandb")).unlink()
    wandb = next(c for c in judge("gpu", run1, run2, out) if c.name == "W&B")
    assert not wandb.ok and "run 2: no W&B run file" in wandb.detail


def test_the_second_run_is_the_rows_it_added_to_the_shared_metrics_file(tmp_path, out):
    """Both runs write one output folder's metrics.jsonl: run 2's metrics are the rows run 1's did not hold."""
    (tmp_path / "wandb" / "offline-run-r1").mkdir(parents=True)
    (tmp_path / "wandb" / "offline-run-r2").mkdir(parents=True)
    rows = [step(0, 0.03), step(1, 0.03)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    run1 = load_run(0, good_log(tmp_path / "wandb" / "offline-run-r1"), tmp_path)
    assert run1.run_dir == tmp_path / "wandb" / "offline-run-r1" and run1.metrics == rows
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps(step(2, 0.03)) + "\n")
    run2 = load_run(0, good_log(tmp_path / "wandb" / "offline-run-r2", resumed=True), tmp_path, earlier=run1)
    assert [m["step"] for m in run2.metrics] == [2]
    # a run 2 that started over replaces run 1's rows (the tracker moves them aside): every step it logged is its own
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(step(i, 0.02)) + "\n" for i in range(3)))
    run2 = load_run(0, good_log(tmp_path / "wandb" / "offline-run-r2"), tmp_path, earlier=run1)
    assert [m["step"] for m in run2.metrics] == [0, 1, 2]
    resume = next(c for c in judge("gpu", run1, run2, out) if c.name == "resume")
    assert not resume.ok and "trained steps [0, 1, 2]" in resume.detail


def test_gpu_mode_needs_pretrain_and_a_new_folder(tmp_path, capsys):
    assert main(["--output-dir", str(tmp_path / "new")]) == 2
    assert "needs --pretrain DIR" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "run1.log").write_text("")
    assert main(["--cpu", "--output-dir", str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_the_report_and_exit_code_tell_the_three_verdicts_apart():
    checks = [Check("train step", PASS, "a"), Check("weight sync", INCONCLUSIVE, "b")]
    lines = report(checks).splitlines()
    assert lines[0].startswith("PASS          train step ") and lines[1].startswith("INCONCLUSIVE  weight sync")
    assert exit_code(checks) == 3
    assert exit_code([*checks, Check("resume", FAIL, "c")]) == 1
    assert exit_code(checks[:1]) == 0
    assert report(checks[:1]) == "PASS  train step  a"  # all passed: the format docs/guides/gpu.md shows


def test_the_cpu_twin_rewards_vary_with_the_answer():
    """The twin's tiny model never answers right: a reward that varies within a group is what gives it a gradient."""
    assert digit_share("", "7") == 0.0
    assert digit_share("ab12", "7") == 0.5
    assert digit_share("1234", "0") == 1.0
