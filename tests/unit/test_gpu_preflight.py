"""The GPU preflight's report: each check passes on what a good run leaves and fails on what each fault leaves.
The runs are described by their logs and metrics (what the report reads); tests/e2e runs the real CPU twin."""

import json
from pathlib import Path

import pytest

from entropy_openrlhf.pipeline.gpu_preflight import CHECKS, Run, judge, load_run, main


def good_log(run_dir: Path, backend: str = "nccl", resumed: bool = False) -> str:
    lines = [
        f"[entropy-openrlhf] kl_cov: model /m, 64 train / 0 test prompts, W&B run {run_dir}",
        "[entropy-openrlhf] actors started in 40 s: rollout on 10.0.0.1; policy on 10.0.0.1, 10.0.0.1",
        f"[entropy-openrlhf] weight sync: collective over {backend}, 3 ranks",
    ]
    if resumed:
        lines.append("[entropy-openrlhf] resumed from /out/checkpoints/step2 at step 2")
    return "\n".join(lines)


def step(i: int, gap: float, **extra) -> dict:
    return {"step": i, "rollout/logprob_diff_mean": gap, "time/sync": 0.0 if i == 0 else 1.5,
            "loss/policy": 0.1, "train/skipped_steps": 0.0, "train/grad_norm": 0.7, "loss/ppo_kl": 0.01,
            **extra}  # fmt: skip


def make_run(tmp_path: Path, name: str, metrics: list[dict], backend="nccl", resumed=False, code=0) -> Run:
    run_dir = tmp_path / "wandb" / name
    (run_dir / "files").mkdir(parents=True)
    (run_dir / "files" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / f"run-{name}.wandb").write_bytes(b"")
    return load_run(code, good_log(run_dir, backend, resumed))


@pytest.fixture
def out(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step2"
    (ckpt / "deepspeed").mkdir(parents=True)
    (ckpt / "hf").mkdir()
    for name in ("trainer_state.json", "hf/config.json", "hf/tokenizer_config.json"):
        (ckpt / name).write_text("{}")
    return tmp_path


def verdicts(checks) -> dict[str, bool]:
    assert [c.name for c in checks] == list(CHECKS)
    return {c.name: c.ok for c in checks}


def test_a_good_gpu_run_passes_every_check(out):
    run1 = make_run(out, "r1", [step(0, 0.030), step(1, 0.034)])
    run2 = make_run(out, "r2", [step(2, 0.029)], resumed=True)
    assert all(verdicts(judge("gpu", run1, run2, out)).values())


def test_an_engine_that_kept_old_weights_fails_the_sync_check_only(out):
    run1 = make_run(out, "r1", [step(0, 0.030), step(1, 0.034)])
    run2 = make_run(out, "r2", [step(2, 0.075)], resumed=True)  # resumed engines never got the checkpoint
    result = verdicts(judge("gpu", run1, run2, out))
    assert result.pop("weight sync") is False and all(result.values())


def test_the_bound_is_twice_the_floor_plus_the_slack(out):
    run1 = make_run(out, "r1", [step(0, 1e-3), step(1, 2e-3 + 0.9e-5)])
    run2 = make_run(out, "r2", [step(2, 2e-3 + 1.1e-5)], resumed=True)
    sync = next(c for c in judge("gpu", run1, run2, out) if c.name == "weight sync")
    assert not sync.ok and "bound 0.002" in sync.detail


def test_a_sync_that_never_ran_fails(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03, **{"time/sync": 0.0})])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    assert verdicts(judge("gpu", run1, run2, out))["weight sync"] is False


def test_a_step_too_small_to_tell_a_stale_engine_says_so(out):
    run1 = make_run(out, "r1", [step(0, 0.03, **{"loss/ppo_kl": 1e-4}), step(1, 0.03, **{"loss/ppo_kl": 1e-4})])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    sync = next(c for c in judge("gpu", run1, run2, out) if c.name == "weight sync")
    assert sync.ok and "a stale engine would go unseen" in sync.detail


def test_gloo_on_gpus_fails_the_group_check(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)], backend="gloo")
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    group = next(c for c in judge("gpu", run1, run2, out) if c.name == "sync group")
    assert not group.ok and "expected nccl" in group.detail
    assert verdicts(judge("cpu", run1, run2, out))["sync group"] is True


def test_skipped_or_non_finite_steps_fail_the_train_check(out):
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    skipped = make_run(out, "a", [step(0, 0.03), step(1, 0.03, **{"train/skipped_steps": 1.0})])
    nan = make_run(out, "b", [step(0, 0.03, **{"loss/policy": float("nan")}), step(1, 0.03)])
    for run1 in (skipped, nan):
        assert verdicts(judge("gpu", run1, run2, out))["train step"] is False


def test_an_incomplete_checkpoint_fails(out):
    (out / "checkpoints" / "step2" / "hf" / "tokenizer_config.json").unlink()
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    ckpt = next(c for c in judge("gpu", run1, run2, out) if c.name == "checkpoint")
    assert not ckpt.ok and "hf/tokenizer_config.json" in ckpt.detail


def test_a_run_2_that_started_over_fails_the_resume_check(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)])
    fresh = make_run(out, "r2", [step(0, 0.03), step(1, 0.03), step(2, 0.03)], resumed=False)
    assert verdicts(judge("gpu", run1, fresh, out))["resume"] is False


def test_a_run_that_failed_at_start_names_its_error(out):
    run1 = Run(2, "error: the run does not fit the Ray cluster: needs 4 GPUs, the cluster has 2 free: ...")
    checks = judge("gpu", run1, None, out)
    engine = checks[0]
    assert not engine.ok and engine.detail.startswith("error: the run does not fit")
    result = verdicts(checks)
    assert not any(v for k, v in result.items() if k != "checkpoint")  # the fixture's checkpoint is not run 1's


def test_a_missing_wandb_run_file_fails(out):
    run1 = make_run(out, "r1", [step(0, 0.03), step(1, 0.03)])
    run2 = make_run(out, "r2", [step(2, 0.03)], resumed=True)
    next(run2.run_dir.glob("*.wandb")).unlink()
    wandb = next(c for c in judge("gpu", run1, run2, out) if c.name == "W&B")
    assert not wandb.ok and "run 2: no W&B run file" in wandb.detail


def test_gpu_mode_needs_pretrain_and_a_new_folder(tmp_path, capsys):
    assert main(["--output-dir", str(tmp_path / "new")]) == 2
    assert "needs --pretrain DIR" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "run1.log").write_text("")
    assert main(["--cpu", "--output-dir", str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err
