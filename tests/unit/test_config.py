import contextlib
import dataclasses
import io
import json
import warnings
from pathlib import Path

import pytest

from entropy_openrlhf.config import Config, ConfigError, build_parser, from_args, validate
from entropy_openrlhf.pipeline.run import resolve_data
from entropy_openrlhf.presets import PIPELINES, PRESETS


def test_dotted_flags_set_nested_fields_with_types():
    cfg = from_args(
        ["--actor.lr", "3e-6", "--loss.kl_cov.ratio", "0.002", "--async.max_staleness", "0", "--pretrain", "/m",
         "--data.apply_chat_template", "false", "--actor.adam_betas", "0.9,0.95"]
    )  # fmt: skip
    assert cfg.actor.lr == 3e-6
    assert cfg.loss.kl_cov.ratio == 0.002
    assert cfg.async_.max_staleness == 0 and not cfg.is_async
    assert cfg.model.pretrain == "/m"
    assert cfg.data.apply_chat_template is False
    assert cfg.actor.adam_betas == [0.9, 0.95]


def test_order_defaults_then_pipeline_then_preset_then_flags():
    cfg = from_args(["--preset", "smoke", "--train.num_steps", "7"], PIPELINES["clip_cov"])
    assert cfg.loss.type == "clip_cov" and cfg.loss.clip_low == 1.0  # pipeline
    assert cfg.model.pretrain == "tiny"  # preset
    assert cfg.train.num_steps == 7  # flag beats preset


def test_paper_presets_carry_the_paper_ratios():
    seven = from_args(["--preset", "qwen2.5-7b-dapo"], PIPELINES["kl_cov"])
    big = from_args(["--preset", "qwen2.5-32b-dapo"], PIPELINES["kl_cov"])
    assert seven.loss.kl_cov.ratio == 2e-3 and big.loss.kl_cov.ratio == 2e-4
    for cfg in (seven, big):
        assert cfg.loss.kl_cov.coef == 1.0 and cfg.actor.lr == 1e-6 and cfg.train.mini_batches == 8
        assert cfg.rollout.batch_size == 256 and cfg.rollout.n_samples_per_prompt == 8
        assert cfg.rollout.max_new_tokens == 8192 and cfg.algo.kl_coef == 0.0
        validate(cfg)
    clip = from_args(["--preset", "qwen2.5-7b-dapo"], PIPELINES["clip_cov"])
    assert (clip.loss.clip_low, clip.loss.clip_high, clip.loss.clip_cov.ratio) == (1.0, 1.0, 2e-4)


def test_unknown_flag_and_preset_are_named():
    with pytest.raises(SystemExit):
        from_args(["--actor.lrr", "1"])
    with pytest.raises(ValueError, match="--preset 'nope'"):
        from_args(["--preset", "nope"])


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("loss.kl_cov.ratio", 0.0, "--loss.kl_cov.ratio"),
        ("loss.kl_cov.ratio", 1.5, "--loss.kl_cov.ratio"),
        ("loss.clip_cov.ratio", -1e-4, "--loss.clip_cov.ratio"),
        ("actor.lr", -1e-6, "--actor.lr"),
        ("actor.lr_scheduler", "step", "--actor.lr_scheduler"),
        ("actor.lr_warmup_steps", -1, "--actor.lr_warmup_steps"),
        ("actor.lr_warmup_steps", 40, "--actor.lr_warmup_steps: 40 is not below the run's 40 optimizer steps"),
        ("actor.min_lr_ratio", 1.0, "--actor.min_lr_ratio"),
        ("actor.min_lr_ratio", 0.1, "--actor.min_lr_ratio: a constant schedule"),  # the default schedule is constant
        ("async.max_staleness", -1, "--async.max_staleness"),
        ("loss.type", "dpo", "--loss.type"),
        ("loss.scope", "rank", "--loss.scope"),
        ("train.mini_batches", 3, "--train.mini_batches"),
        ("algo.advantage", "gae", "--algo.advantage"),
        ("sync.max_chunk_mb", 0.0, "--sync.max_chunk_mb"),
        ("sync.max_chunk_mb", 4096.0, "--sync.max_chunk_mb"),
        ("data.builtin_levels", "3,5", "--data.builtin_levels"),
        ("data.builtin_levels", "3,3", "--data.builtin_levels"),
        ("data.builtin_levels", "", "--data.builtin_levels"),
    ],
)
def test_out_of_range_values_name_the_flag(flag, value, needle):
    cfg = from_args([])
    from entropy_openrlhf.config import set_by_path

    set_by_path(cfg, flag, value)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(cfg)


def test_global_scope_that_pools_nothing_says_so():
    # the study's shape: 4 prompts x 4 samples in 4 mini-batches of 4 sequences, one micro-batch of 4 each
    shape = ["--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "4",
             "--actor.micro_batch_size", "4", "--loss.scope", "global"]  # fmt: skip

    def scope_notes(pipeline: str, *flags: str) -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [n for n in validate(from_args([*shape, *flags], PIPELINES[pipeline])) if "--loss.scope" in n]

    (note,) = scope_notes("clip_cov")
    assert "each optimizer mini-batch (4 sequences) is one micro-batch (--actor.micro_batch_size 4)" in note
    assert scope_notes("kl_cov")  # every selecting objective
    assert not scope_notes("grpo")  # ppo selects nothing: the scope does not apply
    assert not scope_notes("clip_cov", "--train.mini_batches", "2")  # 8 sequences: two micro-batches to pool
    assert not scope_notes("clip_cov", "--actor.num_workers", "2")  # pooled over the ranks
    assert not scope_notes("clip_cov", "--loss.scope", "micro_batch")


def test_kl_cov_with_one_optimizer_step_warns_that_it_is_plain_policy_gradient():
    cfg = from_args(["--train.mini_batches", "1"], PIPELINES["kl_cov"])
    with pytest.warns(UserWarning, match="plain policy gradient"):
        notes = validate(cfg)
    assert notes
    ok = from_args(["--train.mini_batches", "2"], PIPELINES["kl_cov"])
    assert not [n for n in validate(ok) if "plain policy gradient" in n]
    # one mini-batch trained twice: the second pass is off the old weights, and the penalty acts there
    twice = from_args(["--train.mini_batches", "1", "--train.ppo_epochs", "2"], PIPELINES["kl_cov"])
    assert not [n for n in validate(twice) if "plain policy gradient" in n]


def test_ppo_epochs_below_one_is_a_config_error_naming_the_flag():
    with pytest.raises(ConfigError, match="--train.ppo_epochs: 0 must be >= 1"):
        validate(from_args(["--train.ppo_epochs", "0"]))


def test_help_lists_every_field():
    text = build_parser().format_help()
    keys = list(Config().flatten())
    assert len(keys) > 50
    for key in keys:
        assert f"--{key}" in text


def help_of(argv: list[str], pipeline: str) -> str:
    """What `pipelines/<pipeline>.py <argv> --help` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stopped:
        from_args([*argv, "--help"], PIPELINES[pipeline])
    assert stopped.value.code == 0
    return " ".join(out.getvalue().split())  # argparse wraps lines: compare the words


def test_help_shows_the_pipelines_and_the_presets_values_in_sections():
    clip_cov = help_of([], "clip_cov")
    assert "--loss.type STR the policy objective" in clip_cov and "(docs/algorithms/losses.md) [clip_cov]" in clip_cov
    assert "clip: ppo, clip_cov, high_entropy, ce_gppo [1.0]" in clip_cov  # the pipeline's, not the default 0.2
    seven = help_of(["--preset", "qwen2.5-7b-dapo"], "kl_cov")
    assert "--rollout.batch_size INT prompts per RL step [256]" in seven
    assert "qwen2.5-32b-dapo [qwen2.5-7b-dapo]" in seven and "(docs/algorithms/losses.md) [kl_cov]" in seven
    # a short usage line, then the run's own flag, then one group per section
    assert seven.startswith("usage: ") and seven.index("the run: --preset") < seven.index("--model.*: --model.pretrain")
    assert seven.index("--model.*:") < seven.index("--loss.*:") and "[--actor.lr FLOAT]" not in seven
    # the shown values are the defaults before the flags: parsing is unchanged
    assert from_args(["--preset", "qwen2.5-7b-dapo", "--rollout.batch_size", "3"]).rollout.batch_size == 3


def test_looking_up_the_preset_for_help_leaves_flag_errors_as_they_were(capsys):
    def exit_of(argv):
        with pytest.raises(SystemExit) as stopped:
            from_args(argv)
        captured = capsys.readouterr()
        return stopped.value.code, captured.err.strip()

    code, err = exit_of(["--preset"])
    assert code == 2 and "error: argument --preset: expected one argument" in err and "\n" not in err  # one line
    code, err = exit_of(["--preset", "nope", "--bad.flag", "1"])
    assert code == 2 and "unrecognized arguments: --bad.flag 1" in err and "\n" not in err  # the flag, first
    code, err = exit_of(["--data.system_prompt", "--preset", "smoke"])
    assert code == 2 and "argument --data.system_prompt: expected one argument" in err
    code, _ = exit_of(["--preset", "nope", "--help"])
    assert code == 0  # help still prints; the unknown preset is reported on a real run
    with pytest.raises(ValueError, match="--preset 'nope': unknown"):
        from_args(["--preset", "nope"])
    assert from_args(["--preset=smoke"]).preset == "smoke" and from_args(["--preset", "smoke"]).train.num_steps == 2


def test_flatten_is_flat_and_complete():
    flat = Config().flatten()
    assert flat["loss.kl_cov.coef"] == 1.0 and flat["async.max_staleness"] == 1
    assert not any(dataclasses.is_dataclass(v) for v in flat.values())
    assert all(name in PRESETS for name in ("smoke", "qwen2.5-7b-dapo", "qwen2.5-32b-dapo"))


# ---------------------------------------------------------------------------------------------- vLLM engine flags


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--rollout.gpu_memory_utilization", "1.5"], "--rollout.gpu_memory_utilization: 1.5 must be in (0, 1]"),
        (["--rollout.gpu_memory_utilization", "-0.1"], "--rollout.gpu_memory_utilization: -0.1"),
        (["--rollout.enforce_eager", "yes"], "--rollout.enforce_eager: 'yes': auto | true | false"),
        (["--rollout.max_num_seqs", "-1"], "--rollout.max_num_seqs: must be >= 0"),
        (["--rollout.max_num_batched_tokens", "-8"], "--rollout.max_num_batched_tokens: must be >= 0"),
        (
            ["--rollout.max_num_seqs", "512", "--rollout.max_num_batched_tokens", "256"],
            "--rollout.max_num_batched_tokens: 256 is below --rollout.max_num_seqs 512",
        ),
    ],
)
def test_bad_vllm_engine_flags_fail_in_one_line_naming_the_flag(flags, needle):
    with pytest.raises(ConfigError) as e:
        validate(from_args(flags))
    assert str(e.value).startswith("invalid config: --rollout.") and "\n" not in str(e.value)
    assert needle in str(e.value)


def test_vllm_engine_flags_parse_and_default_to_auto_or_vllm_s_own():
    cfg = from_args([])
    r = cfg.rollout
    assert (r.gpu_memory_utilization, r.enforce_eager, r.enable_prefix_caching) == (0.0, "auto", True)
    assert (r.max_num_seqs, r.max_num_batched_tokens) == (0, 0)
    cfg = from_args(["--rollout.gpu_memory_utilization", "0.75", "--rollout.enforce_eager", "false",
                     "--rollout.enable_prefix_caching", "false", "--rollout.max_num_seqs", "64",
                     "--rollout.max_num_batched_tokens", "8192"])  # fmt: skip
    validate(cfg)
    r = cfg.rollout
    assert (r.gpu_memory_utilization, r.enforce_eager, r.enable_prefix_caching) == (0.75, "false", False)
    assert (r.max_num_seqs, r.max_num_batched_tokens) == (64, 8192)


def test_builtin_levels_reach_the_written_task(tmp_path):
    cfg = from_args(["--data.builtin_levels", "3,4", "--train.output_dir", str(tmp_path)])
    validate(cfg)
    assert cfg.data.levels() == (3, 4)
    train, (test,) = resolve_data(cfg)
    for path in (train, test):
        levels = {json.loads(line)["level"] for line in Path(path).read_text().splitlines()}
        assert levels == {3, 4}, path


def test_the_reference_runs_only_when_something_uses_it():
    assert not from_args([]).uses_reference  # auto, no KL term: no reference group, no reference forward
    assert from_args(["--algo.kl_coef", "0.01"]).uses_reference  # auto with a KL term
    assert from_args(["--ref.enabled", "true"]).uses_reference  # the kl/ref metric alone
    with pytest.raises(ConfigError, match=r"--algo\.kl_coef: needs the reference model"):
        validate(from_args(["--ref.enabled", "false", "--algo.kl_coef", "0.01"]))
    with pytest.raises(ConfigError, match=r"--ref\.enabled"):
        validate(from_args(["--ref.enabled", "yes"]))
