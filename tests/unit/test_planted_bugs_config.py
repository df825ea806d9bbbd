"""Config checks whose absence a run pays for mid-way: each bad value is a ConfigError naming its flag before any
actor starts, its nearest good value is accepted (so the check is where the docs put the edge), and through the
real entry point (pipeline.main.main) the run exits 2 with one line before Ray starts."""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

from entropy_openrlhf.config import ConfigError, from_args, validate
from entropy_openrlhf.presets import PIPELINES
from tests.unit.test_bad_input import jsonl, model, no_ray, run  # noqa: F401  (fixtures used by name)

ROOT = Path(__file__).parents[2]


def quiet_validate(argv: list[str]) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return validate(from_args(argv, PIPELINES["kl_cov"]))


def refused(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        quiet_validate(argv)
    return str(e.value)


# ------------------------------------------------------------------------------------------ the overlong buffer


@pytest.mark.parametrize(
    "argv, limit",
    [
        (["--rollout.max_new_tokens", "64", "--reward.overlong_buffer_len", "65"], 64),
        # the preset's limit (24), not the flag's default (128), is what the buffer is checked against
        (["--preset", "smoke", "--reward.overlong_buffer_len", "30"], 24),
        # a flag after the preset lowers the limit under the buffer
        (
            [
                "--preset",
                "qwen2.5-7b-dapo",
                "--reward.overlong_buffer_len",
                "4096",
                "--rollout.max_new_tokens",
                "2048",
                "--data.test",
                "t.jsonl",
            ],
            2048,
        ),  # fmt: skip
    ],
)
def test_an_overlong_buffer_longer_than_the_responses_is_refused(argv, limit):
    """Catches an overlong buffer longer than --rollout.max_new_tokens accepted: DAPO's penalty would then raise at
    the first scored batch, after every model has loaded."""
    buffer = argv[argv.index("--reward.overlong_buffer_len") + 1]
    message = refused(argv)
    assert f"--reward.overlong_buffer_len: {buffer} is longer than --rollout.max_new_tokens {limit}" in message


def test_an_overlong_buffer_as_long_as_the_responses_is_accepted():
    quiet_validate(["--preset", "smoke", "--reward.overlong_buffer_len", "24"])  # the penalty over the whole length


def test_an_overlong_buffer_too_long_for_the_preset_stops_the_run_before_ray(model, tmp_path, capsys, no_ray):  # noqa: F811
    """The same through the entry point: exit 2, one line naming the flag, nothing started."""
    code, err = run(["--preset", "smoke", "--pretrain", model, "--train.output_dir", str(tmp_path / "out"),
                     "--reward.overlong_buffer_len", "30"], capsys)  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--reward.overlong_buffer_len: 30" in lines[0], err


# ------------------------------------------------------------------------------------------ one section's ranges


@pytest.mark.parametrize(
    "flag, bad, good, needle",
    [
        # dropout 1 zeroes the adapter's input: the adapters never learn; >= 1 is no probability at all
        ("--actor.lora_dropout", ["1", "1.5", "-0.1"], ["0", "0.99"], "must be in [0, 1)"),
        # AdamW divides by sqrt(v) + eps: 0 turns a parameter with no gradient yet into 0 / 0
        ("--actor.adam_eps", ["0", "-1e-8"], ["1e-12"], "must be > 0"),
        # a negative factor pays a response for running into the limit
        ("--reward.overlong_penalty_factor", ["-0.5"], ["0", "1"], "must be >= 0"),
        # fewer resamples than 100 give no 2.5 and 97.5 percentiles worth the name
        ("--eval.bootstrap", ["1", "99"], ["100"], "at least 100 resamples"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_flag_and_the_edge_is_accepted(flag, bad, good, needle):
    """Catches the range check of --actor.lora_dropout (>= 1), --actor.adam_eps (0),
    --reward.overlong_penalty_factor (negative: a bonus for running long) and --eval.bootstrap (under 100) gone or
    moved: each bad value is refused in one line naming the flag, each value at the edge accepted."""
    for value in bad:
        message = refused([flag, value])
        assert message.startswith(f"invalid config: {flag}: ") and needle in message and "\n" not in message
    for value in good:
        quiet_validate([flag, value])


# ------------------------------------------------------------------------------------ evaluation without test data


def test_evaluating_without_a_test_set_is_refused_naming_both_flags(tmp_path):
    """Catches --eval.every N with --data.train and no --data.test accepted: the run would evaluate nothing, said
    once in a start-up line that scrolls past."""
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": "1 + 1?", "label": "2"}])
    for test in ([], ["--data.test", " , "]):
        message = refused(["--data.train", train, "--eval.every", "4", *test])
        assert "--eval.every: 4" in message and "--data.test" in message and "--eval.every 0" in message
    # a test set, evaluation off, or the built-in task (which brings its test split) are fine
    quiet_validate(["--data.train", train, "--eval.every", "4", "--data.test", train])
    quiet_validate(["--data.train", train, "--eval.every", "0"])
    quiet_validate(["--eval.every", "4"])


def test_the_dapo_presets_evaluate_only_with_a_test_set(tmp_path):
    """The recipe presets evaluate every 4 steps (verl's test_freq) and train on the user's data: without
    --data.test they are refused, with it they pass."""
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": "1 + 1?", "label": "2"}])
    for preset in ("qwen2.5-7b-dapo", "qwen2.5-32b-dapo"):
        assert "--eval.every: 4" in refused(["--preset", preset, "--data.train", train])
        quiet_validate(["--preset", preset, "--data.train", train, "--data.test", train])


def test_evaluating_without_a_test_set_stops_the_run_before_ray(model, tmp_path, capsys, no_ray):  # noqa: F811
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": "1 + 1?", "label": "2"}])
    code, err = run(["--preset", "smoke", "--pretrain", model, "--train.output_dir", str(tmp_path / "out"),
                     "--data.train", train, "--eval.every", "2"], capsys)  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--eval.every: 2" in lines[0] and "--data.test" in lines[0]


def test_the_readme_s_real_run_passes_the_config_checks():
    """The README's `ray job submit` command for the 7B preset is a run the config checks accept (it gives a test
    set for the preset's evaluations)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(ray job submit .*?--preset qwen2\.5-7b-dapo.*?)```", text, re.S)
    assert block, "the README's real-run command"
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    script = argv.index("pipelines/kl_cov.py")
    flags = argv[script + 1 :]
    assert "--data.test" in flags
    quiet_validate(flags)
