"""Which checkpoint a resume continues from, and the runs it refuses (another seed, prompt count or shuffle setting;
under a learning-rate schedule, other optimizer steps per RL step or another schedule)."""

import json

import pytest

from entropy_openrlhf.config import ConfigError, from_args
from entropy_openrlhf.pipeline.checkpoints import resume_point


def cfg_in(tmp_path, *flags: str):
    return from_args(["--preset", "smoke", "--train.output_dir", str(tmp_path), *flags], {})


def save(tmp_path, step: int, seed: int = 42, prompts: int = 64) -> None:
    folder = tmp_path / "checkpoints" / f"step{step}"
    folder.mkdir(parents=True)
    state = {"step": step, "stream_epoch": 0, "stream_offset": 4 * step, "seed": seed, "train_prompts": prompts}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert resume_point(cfg_in(tmp_path), 64) is None


def test_the_newest_complete_checkpoint_and_its_state(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    ckpt, state = resume_point(cfg_in(tmp_path), 64)
    assert ckpt == tmp_path / "checkpoints" / "step4" and state["stream_offset"] == 16


def test_another_seed_is_refused_naming_the_flag(tmp_path):
    save(tmp_path, 2, seed=42)
    with pytest.raises(ConfigError, match=r"step2 was written with --train.seed 42, this run has 5"):
        resume_point(cfg_in(tmp_path, "--train.seed", "5"), 64)


def test_another_prompt_count_is_refused_naming_the_flags(tmp_path):
    save(tmp_path, 2, prompts=64)
    with pytest.raises(ConfigError, match=r"--data.train / --data.max_samples \(prompt count\) 64, this run has 32"):
        resume_point(cfg_in(tmp_path), 32)


def test_other_optimizer_steps_per_step_are_refused_under_a_schedule_only(tmp_path):
    save(tmp_path, 2)
    state_path = tmp_path / "checkpoints" / "step2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "optimizer_steps_per_step": 4}))  # 2 mini-batches x 2 passes
    cosine = ("--actor.lr_scheduler", "cosine", "--train.mini_batches", "2")
    with pytest.raises(ConfigError, match=r"step2 was written with 4 optimizer steps per RL step .* this run has 2"):
        resume_point(cfg_in(tmp_path, *cosine), 64)
    assert resume_point(cfg_in(tmp_path, *cosine, "--train.ppo_epochs", "2"), 64) is not None  # the same 4
    assert resume_point(cfg_in(tmp_path, "--train.mini_batches", "2"), 64) is not None  # a constant rate: no matter
    with pytest.raises(ConfigError, match=r"--actor.lr_warmup_steps 3\) counts optimizer steps"):
        resume_point(cfg_in(tmp_path, "--actor.lr_warmup_steps", "3", "--train.mini_batches", "2"), 64)


def test_another_learning_rate_schedule_is_refused_naming_what_changed(tmp_path):
    from entropy_openrlhf.pipeline.checkpoints import schedule_settings

    cosine = ("--actor.lr_scheduler", "cosine", "--train.num_steps", "100")
    save(tmp_path, 50)
    state_path = tmp_path / "checkpoints" / "step50" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "lr_schedule": schedule_settings(cfg_in(tmp_path, *cosine))}))
    assert resume_point(cfg_in(tmp_path, *cosine), 64) is not None  # the same schedule
    # 50 of 100 steps done, resumed as a run of 200: the cosine would jump from its middle to a quarter of the way
    with pytest.raises(ConfigError, match=r"another learning-rate schedule \(optimizer steps in the run .* 200 -> 400"):
        resume_point(cfg_in(tmp_path, "--actor.lr_scheduler", "cosine", "--train.num_steps", "200"), 64)
    with pytest.raises(ConfigError, match=r"--actor.min_lr_ratio 0.0 -> 0.1"):
        resume_point(cfg_in(tmp_path, *cosine, "--actor.min_lr_ratio", "0.1"), 64)
    assert resume_point(cfg_in(tmp_path, "--train.num_steps", "200"), 64) is not None  # a constant rate: no matter


def test_another_shuffle_setting_is_refused(tmp_path):
    save(tmp_path, 2)
    state_path = tmp_path / "checkpoints" / "step2" / "trainer_state.json"
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "shuffle": True}))
    with pytest.raises(ConfigError, match=r"written with --data.shuffle True, this run has False"):
        resume_point(cfg_in(tmp_path, "--data.shuffle", "false"), 64)
