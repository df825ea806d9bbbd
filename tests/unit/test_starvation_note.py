"""What a run does about its step metrics (Trainer._check_step): the note it prints once when a covariance
objective's selection barely acts (trainer.starvation_note), naming the numbers and only advice that could help, and
the stops after steps with a non-finite loss or with no response scored."""

from types import SimpleNamespace

import pytest

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.run_notes import starvation_note
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.presets import PIPELINES


def config(pipeline: str, *flags: str):
    return from_args(list(flags), PIPELINES[pipeline])


# a step whose covariances are spread but whose quota is the one-token floor (4 micro-batches of ~80 tokens)
SPREAD = {"loss/select_tokens": 80.0, "loss/kl_cov_frac": 0.0125, "cov/p99": 0.42, "cov/max": 1.3}
# a step in which every sample of every group scored alike: all advantages, hence all covariances, are 0
SILENT = {"loss/select_tokens": 80.0, "loss/clip_cov_frac": 0.0, "cov/p99": 0.0, "cov/max": 0.0}


def test_kl_cov_at_its_floor_is_told_it_selects_more_than_its_ratio_not_less():
    # the floor's one token of ~80 (1.25%) is five times the 0.2% the ratio asks for: not starvation
    note = starvation_note(config("kl_cov", "--loss.kl_cov.ratio", "0.002"), SPREAD)
    assert "barely acts" not in note and "Raise --loss.kl_cov.ratio" not in note, note
    assert "floor(0.002 x ~80 tokens)) was one token" in note and "cov p99 0.42" in note, note
    assert "acted on 1.25% of tokens, more than the 0.20% the ratio asks for" in note, note
    assert "about 500 tokens per selection" in note and "--loss.scope global" in note, note


def test_objectives_without_a_floor_say_nothing():
    for pipeline in ("grpo", "high_entropy"):
        assert starvation_note(config(pipeline), SPREAD) is None, pipeline


def test_clip_cov_at_the_paper_s_setting_is_pointed_to_the_small_scale_preset():
    metrics = {**SPREAD, "loss/clip_cov_frac": 0.0, "loss/clip_cov_in_bounds": 0.0}
    note = starvation_note(config("clip_cov"), metrics)
    assert "against bounds (1, 5), 0.0% of tokens inside them" in note
    assert "--preset clip-cov-small" in note


def test_clip_cov_narrower_than_the_preset_is_pointed_to_it():
    # the study's first small-scale setting: bounds in std, but from 1 std with a ratio of 0.05
    metrics = {**SPREAD, "loss/clip_cov_frac": 0.0, "loss/clip_cov_in_bounds": 0.0, "loss/clip_cov_lb": 0.1}
    flags = ("--loss.clip_cov.bounds_unit", "std", "--loss.clip_cov.ratio", "0.05")
    note = starvation_note(config("clip_cov", *flags), metrics)
    assert "Use --preset clip-cov-small (ratio 0.1," in note and "bounds from 0.5 covariance std" in note, note
    note = starvation_note(config("clip_cov", *flags, "--loss.clip_cov.ratio", "0.1"), metrics)
    assert "Use --preset clip-cov-small" in note, note  # the ratio is the preset's, the lower bound (1) is not
    wider = ("--loss.clip_cov.ratio", "0.2", "--loss.clip_cov.lb", "0.3")
    note = starvation_note(config("clip_cov", *flags, *wider), metrics)
    assert "--preset" not in note and "Widen the bounds" in note, note


def test_clip_cov_already_at_the_preset_is_not_sent_back_to_it():
    metrics = {**SPREAD, "loss/clip_cov_frac": 0.0, "loss/clip_cov_in_bounds": 0.0, "loss/clip_cov_lb": 0.05}
    note = starvation_note(config("clip_cov", "--preset", "clip-cov-small"), metrics)
    assert "x the covariance std (lower bound ~0.05)" in note
    assert "--preset clip-cov-small" not in note and "--loss.clip_cov.lb" in note


def test_steps_without_any_advantage_are_named_as_such_with_no_objective_advice():
    for pipeline, flags in (("clip_cov", ("--preset", "clip-cov-small")), ("kl_cov", ())):
        note = starvation_note(config(pipeline, *flags), SILENT)
        assert "all advantages were 0" in note and "--rollout.n_samples_per_prompt" in note, note
        assert "--preset" not in note and f"--loss.{pipeline}.ratio" not in note, note


def bare_trainer(cfg):
    """A Trainer without actors: what its step checks (`_check_step`) read."""
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.starvation_said = cfg, False
    trainer._starved_run = trainer._nonfinite_run = trainer._unscored_run = 0
    return trainer


def test_the_run_says_it_once_after_three_starved_steps_in_a_row(capsys):
    trainer = bare_trainer(config("kl_cov"))
    starved = {**SPREAD, "loss/select_starved": 1.0}
    for step, metrics in enumerate([starved, starved, {**SPREAD, "loss/select_starved": 0.0}, starved, starved]):
        trainer._check_step(step, metrics, [])
    assert capsys.readouterr().out == ""  # never three in a row yet
    trainer._check_step(5, starved, [])
    assert "floor(0.002 x ~80 tokens)) was one token" in capsys.readouterr().out
    for step in range(6, 12):
        trainer._check_step(step, starved, [])
    assert capsys.readouterr().out == ""  # once per run


def test_the_run_stops_after_max_nonfinite_steps_skipped_in_a_row():
    trainer = bare_trainer(config("grpo", "--train.max_nonfinite_steps", "2"))
    skipped, clean = {"train/skipped_steps": 1.0}, {"train/skipped_steps": 0.0}
    for step, metrics in enumerate([skipped, clean, skipped]):
        trainer._check_step(step, metrics, [])  # a clean step in between starts the count again
    with pytest.raises(RuntimeError, match=r"^2 consecutive RL steps .* stopping at step 3 \(--train.max_nonfin"):
        trainer._check_step(3, skipped, [])
    # at 0 the first skipped step stops the run, and a clean one never does
    trainer = bare_trainer(config("grpo", "--train.max_nonfinite_steps", "0"))
    trainer._check_step(0, clean, [])
    with pytest.raises(RuntimeError, match=r"^1 consecutive RL steps .* stopping at step 1"):
        trainer._check_step(1, skipped, [])


def failed(error: str | None) -> SimpleNamespace:
    """A sample the verifier failed on: raised `error`, or timed out (None)."""
    return SimpleNamespace(reward_info={"error": error, "timed_out": error is None})


def test_the_run_stops_after_max_failed_steps_in_which_the_verifier_scored_nothing():
    trainer = bare_trainer(config("grpo", "--reward.max_failed_steps", "2"))
    none_scored, some = {"reward/scored_frac": 0.0}, {"reward/scored_frac": 0.25}
    raised = [failed(None), failed("KeyError: 'solution'"), failed("KeyError: 'solution'")]
    for step, metrics in enumerate([none_scored, some, none_scored, {}]):
        trainer._check_step(step, metrics, raised)  # a step with any response scored (or no reward metrics) restarts
    trainer._check_step(4, none_scored, raised)
    with pytest.raises(RuntimeError) as error:
        trainer._check_step(5, none_scored, raised)
    message = str(error.value)
    assert message.startswith("the verifier 'math' raised or timed out on every response of 2 consecutive RL steps")
    assert "stopping at step 5 (--reward.max_failed_steps)" in message
    assert "Its last error: KeyError: 'solution'." in message  # the step's own first error, past its timeouts
    trainer = bare_trainer(config("grpo"))  # default 3; a step of timeouts alone has no error to name
    for step in range(2):
        trainer._check_step(step, none_scored, raised)
    with pytest.raises(RuntimeError, match=r"3 consecutive .* Its last error: none: every response timed out"):
        trainer._check_step(2, none_scored, [failed(None)] * 3)
    trainer = bare_trainer(config("grpo", "--reward.max_failed_steps", "0"))  # 0: never stops
    for step in range(20):
        trainer._check_step(step, none_scored, raised)
