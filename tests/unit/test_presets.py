"""Presets: every one validates; the DAPO ones carry the paper's recipe (docs/algorithms/losses.md, "The paper's recipe
in the
presets") and fit their GPUs; GPU specs that cannot work are rejected before any actor starts; the smoke preset stays
CI-sized."""

import re
import warnings
from pathlib import Path

import pytest

from entropy_openrlhf.config import Config, ConfigError, from_args, set_by_path, validate
from entropy_openrlhf.presets import PIPELINES, PRESETS
from entropy_openrlhf.resources import group_resources, required_resources, resource_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guides" / "cluster.md"
DAPO = ("qwen2.5-7b-dapo", "qwen2.5-32b-dapo")


def preset(name: str, pipeline: str = "kl_cov", *flags: str) -> Config:
    """The config `pipelines/<pipeline>.py --preset <name> <flags>` runs with."""
    return from_args(["--preset", name, *flags], PIPELINES[pipeline])


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_validates_on_every_pipeline_without_warnings(name, pipeline):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note would be a warning: the presets need none
        assert validate(preset(name, pipeline)) == []


# docs/algorithms/losses.md, "The paper's recipe in the presets" (and "Clip-Cov" / "KL-Cov" for the loss
# constants), numbers written out here on purpose.
PAPER_RECIPE = {
    "rollout.n_samples_per_prompt": 8,  # GRPO n = 8
    "rollout.batch_size": 256,  # train_batch_size = 256 prompts
    "train.mini_batches": 8,  # ppo_mini_batch_size = 32 prompts: 8 optimizer steps per rollout step
    "actor.lr": 1e-6,  # constant, no warmup (verl recipe; the fork's final 7B scripts use 5e-7)
    "actor.lr_scheduler": "constant",
    "actor.lr_warmup_steps": 0,
    "actor.weight_decay": 0.0,
    "actor.grad_clip": 1.0,
    "rollout.max_new_tokens": 8192,  # max_response_length
    "rollout.max_model_len": 2048 + 8192,  # max_prompt_length + max_response_length
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.tensor_parallel_size": 2,  # vLLM TP = 2
    "algo.advantage": "grpo",
    "algo.kl_coef": 0.0,  # no KL loss, no reference model
    "ref.enabled": "false",
    "algo.dynamic_sampling": True,  # DAPO filter_groups, max_num_gen_batches = 10
    "algo.max_gen_batches": 10,
    "loss.agg": "token_mean",
    "reward.overlong_buffer_len": 0,  # overlong_buffer.enable = False: no length penalty
    "loss.mask_truncated": False,  # truncated responses stay in the loss
    "loss.dual_clip": 0.0,  # clip_ratio_c is ignored by these losses
    "loss.kl_cov.coef": 1.0,  # beta = 1 (verl's yaml default of 0.1 is not the paper's)
    "loss.clip_cov.ratio": 2e-4,
    "loss.clip_cov.lb": 1.0,
    "loss.clip_cov.ub": 5.0,
    "eval.every": 4,  # test_freq
    "train.save_every": 32,  # save_freq
    "data.label_key": "reward_model.ground_truth",  # verl/DAPO rows
}
KL_COV_RATIO = {"qwen2.5-7b-dapo": 2e-3, "qwen2.5-32b-dapo": 2e-4}  # fractions: 0.2 % and 0.02 % of the tokens
CLIPS = {"grpo": (0.2, 0.2), "clip_higher": (0.2, 0.28), "clip_cov": (1.0, 1.0)}  # (eps_low, eps_high) by run


@pytest.mark.parametrize("name", DAPO)
def test_dapo_presets_carry_the_paper_recipe(name):
    flat = preset(name).flatten()
    for key, value in PAPER_RECIPE.items():
        assert flat[key] == value, key
    assert flat["loss.kl_cov.ratio"] == KL_COV_RATIO[name]
    # the schedule is the preset's own, not the flags' defaults
    assert PRESETS[name]["actor.lr_scheduler"] == "constant" and PRESETS[name]["actor.lr_warmup_steps"] == 0
    assert PRESETS[name]["reward.overlong_buffer_len"] == 0 and PRESETS[name]["loss.mask_truncated"] is False
    # no entropy bonus (the paper has none) and the entropy controller (not in the paper either) is off
    assert flat["loss.entropy_coef"] == 0.0
    assert flat["entropy.target"] == ""


@pytest.mark.parametrize("name", DAPO)
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_the_pipeline_sets_the_loss_and_the_preset_does_not_override_it(name, pipeline):
    cfg = preset(name, pipeline)
    assert cfg.loss.type == {"grpo": "ppo", "clip_higher": "ppo"}.get(pipeline, pipeline)
    if pipeline in CLIPS:
        assert (cfg.loss.clip_low, cfg.loss.clip_high) == CLIPS[pipeline]
    assert cfg.loss.kl_cov.ratio == KL_COV_RATIO[name] and cfg.loss.clip_cov.ratio == 2e-4


def test_the_batch_splits_evenly_over_mini_batches_and_ranks():
    for name in DAPO:
        cfg = preset(name)
        sequences = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        per_mini = sequences // cfg.train.mini_batches
        assert sequences == 2048 and per_mini == 256  # 32 prompts x 8 responses per optimizer step
        assert per_mini % cfg.actor.num_workers == 0


def test_seven_b_fits_one_eight_gpu_node():
    cfg = preset("qwen2.5-7b-dapo")
    groups = group_resources(cfg)
    assert groups["rollout"] == {"actors": 2, "GPU": 4.0, "CPU": 2.0}  # 2 engines x TP 2
    assert groups["policy"]["actors"] == 4 and groups["policy"]["GPU"] == 4.0
    assert "reference" not in groups
    assert required_resources(cfg)["GPU"] == 8
    # run straight from a shell, the pipeline starts a local Ray with --ray.num_cpus logical CPUs: it must fit
    assert required_resources(cfg)["CPU"] <= cfg.ray.num_cpus


def test_thirty_two_b_fits_four_eight_gpu_nodes():
    cfg = preset("qwen2.5-32b-dapo")
    groups = group_resources(cfg)
    assert groups["rollout"]["actors"] == 8 and groups["rollout"]["GPU"] == 16.0  # 8 engines x TP 2
    assert groups["policy"]["actors"] == 16 and groups["policy"]["GPU"] == 16.0
    assert required_resources(cfg)["GPU"] == 32
    # every engine (2 GPUs) fits inside one 8-GPU node: the placement never has to split one
    assert 8 % cfg.rollout.num_gpus_per_engine == 0


def test_resources_count_the_reference_only_when_enabled():
    cfg = preset("qwen2.5-7b-dapo", "kl_cov", "--ref.enabled", "true", "--ref.num_gpus", "1", "--ref.num_cpus", "2")
    assert group_resources(cfg)["reference"] == {"actors": 1, "GPU": 1.0, "CPU": 2.0}
    assert required_resources(cfg)["GPU"] == 9  # no longer fits one node: the docs say to take a trainer GPU
    cfg = preset(
        "qwen2.5-7b-dapo", "kl_cov", "--ref.enabled", "true", "--ref.num_gpus", "1", "--actor.num_workers", "3"
    )
    assert required_resources(cfg)["GPU"] == 4 + 3 + 1
    with pytest.raises(ConfigError, match="--train.mini_batches"):  # but 256 sequences do not split over 3 ranks
        validate(cfg)


def test_the_resource_arithmetic_is_plain():
    cfg = Config()
    for key, value in {
        "rollout.num_engines": 3, "rollout.num_gpus_per_engine": 4.0, "rollout.num_cpus_per_engine": 2.0,
        "actor.num_workers": 5, "actor.num_gpus_per_worker": 0.5, "actor.num_cpus_per_worker": 3.0,
        "reward.num_workers": 4, "reward.num_cpus_per_worker": 0.25, "ref.enabled": "true", "ref.num_gpus": 1.0,
        "ref.num_cpus": 1.5,
    }.items():  # fmt: skip
        set_by_path(cfg, key, value)
    assert required_resources(cfg) == {"GPU": 12 + 2.5 + 1, "CPU": 6 + 15 + 1 + 1.5}


def test_docs_table_is_what_the_code_computes():
    """docs/guides/cluster.md shows `python -m entropy_openrlhf.resources` output; a preset change must update it."""
    text = DOCS.read_text()
    for row in resource_table(list(DAPO)).splitlines():
        assert row in text, f"docs/guides/cluster.md is missing or has a stale row:\n{row}"


def test_docs_commands_use_flags_that_exist():
    text = DOCS.read_text()
    known = set(Config().flatten()) | {"preset", "pretrain"}
    used = set(re.findall(r"pipelines/\w+\.py[^`]*", text, flags=re.S))
    flags = {f for block in used for f in re.findall(r"--([a-z_]+(?:\.[a-z_]+)+|preset|pretrain)\b", block)}
    assert flags, "no pipeline commands found in docs/guides/cluster.md"
    assert flags <= known, sorted(flags - known)
    for name in re.findall(r"--preset ([\w.-]+)", text):
        assert name in PRESETS


@pytest.mark.parametrize("name", DAPO)
def test_dapo_presets_tune_vllm_for_long_responses_on_their_own_gpus(name):
    from entropy_openrlhf.actors.rollout import engine_tuning_kwargs

    r = preset(name).rollout
    assert r.enforce_eager == "false"  # CUDA graphs for 8k-token decoding
    assert r.enable_prefix_caching  # the 8 samples of a prompt share its KV blocks
    assert 0.85 <= r.gpu_memory_utilization <= 0.92  # engines own their GPUs; room left for the weight sync
    # one generation round (batch_size x n responses) split over the engines, all admitted at once
    assert r.max_num_seqs == r.batch_size * r.n_samples_per_prompt // r.num_engines
    assert r.max_num_batched_tokens == 0  # vLLM's per-GPU choice
    kwargs = engine_tuning_kwargs(
        on_gpu=True, gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
        enable_prefix_caching=r.enable_prefix_caching, max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
    )  # fmt: skip
    assert kwargs == {"gpu_memory_utilization": 0.9, "enforce_eager": False, "max_num_seqs": r.max_num_seqs}


def test_smoke_keeps_the_cpu_engine_settings():
    r = preset("smoke").rollout
    assert (r.gpu_memory_utilization, r.enforce_eager, r.max_num_seqs, r.max_num_batched_tokens) == (0, "auto", 0, 0)


# ---------------------------------------------------------------------------------------------- bad GPU specs


def test_tensor_parallel_wider_than_the_engine_gpus_is_rejected_naming_both_flags():
    cfg = preset("qwen2.5-7b-dapo", "kl_cov", "--rollout.num_gpus_per_engine", "1")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "--rollout.tensor_parallel_size: 2 needs --rollout.num_gpus_per_engine >= 2" in str(e.value)
    assert "got 1" in str(e.value)


def test_tensor_parallel_on_cpu_engines_is_left_to_vllm():
    """No GPU reserved: nothing to check against (vLLM on CPU decides what TP it supports)."""
    cfg = from_args(["--rollout.tensor_parallel_size", "2"])
    validate(cfg)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("rollout.num_gpus_per_engine", "1.5"),
        ("actor.num_gpus_per_worker", "2.5"),
        ("ref.num_gpus", "-0.5"),  # -1 is auto
        ("rollout.num_cpus_per_engine", "-0.5"),
        ("reward.num_cpus_per_worker", "1.25"),
        ("rollout.tensor_parallel_size", "0"),
    ],
)
def test_resource_amounts_ray_would_refuse_are_rejected_naming_the_flag(flag, value):
    cfg = from_args([f"--{flag}", value])
    with pytest.raises(ConfigError, match=re.escape(f"--{flag}:")):
        validate(cfg)


def test_fractional_gpus_are_legal_for_a_single_trainer_rank_but_not_for_engines():
    validate(from_args(["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "0.5"]))
    # two ranks of half a GPU would be packed onto one device, which NCCL refuses (tests/unit/test_gpu_placement.py)
    with pytest.raises(ConfigError, match="--actor.num_gpus_per_worker: 0.5 with 2 policy ranks"):
        validate(from_args(["--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "0.5",
                            "--actor.num_workers", "2"]))  # fmt: skip
    # an engine's vLLM takes a fixed share of its GPU's memory: RolloutGroup refuses a fraction, and so does validate
    with pytest.raises(ConfigError, match="needs --rollout.num_gpus_per_engine >= 1"):
        validate(from_args(["--rollout.num_gpus_per_engine", "0.5", "--actor.num_gpus_per_worker", "0.5"]))


def test_idle_and_one_sided_gpu_reservations_warn():
    cfg = preset("qwen2.5-7b-dapo", "kl_cov", "--rollout.num_gpus_per_engine", "4")
    with pytest.warns(UserWarning, match="stay idle"):
        validate(cfg)
    cfg = preset("qwen2.5-7b-dapo", "kl_cov", "--actor.num_gpus_per_worker", "0")
    with pytest.warns(UserWarning, match="gets no GPU and runs on the CPU"):
        validate(cfg)


# ---------------------------------------------------------------------------------------------- smoke


def test_smoke_stays_small_and_reserves_no_gpu():
    cfg = preset("smoke")
    assert cfg.model.pretrain == "tiny"
    assert cfg.train.num_steps <= 2
    assert cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt <= 16
    assert cfg.rollout.max_new_tokens <= 32
    assert cfg.rollout.max_model_len <= 1024
    assert required_resources(cfg)["GPU"] == 0  # CI machines have none
    assert required_resources(cfg)["CPU"] <= 4
    assert cfg.actor.zero_stage in (0, 1, 2) and not cfg.actor.gradient_checkpointing
