"""The --rollout vLLM flags on their way to `LLM(...)`: config -> Trainer's RolloutGroup call -> RolloutEngine ->
the LLM keyword arguments. Pure plumbing, tested without starting vLLM or Ray."""

import pytest

from entropy_openrlhf.actors import engine, rollout
from entropy_openrlhf.actors.rollout import engine_tuning_kwargs
from entropy_openrlhf.config import from_args


def test_auto_is_eager_at_0_8_on_cpu_exactly_as_before():
    # the CPU engine always ran LLM(..., gpu_memory_utilization=0.8, enforce_eager=True)
    assert engine_tuning_kwargs(on_gpu=False) == {"gpu_memory_utilization": 0.8, "enforce_eager": True}


def test_auto_on_gpus_uses_cuda_graphs_and_leaves_vllm_s_scheduler_defaults():
    assert engine_tuning_kwargs(on_gpu=True) == {"gpu_memory_utilization": 0.9, "enforce_eager": False}


def test_explicit_values_reach_the_kwargs_and_only_non_defaults_are_passed():
    kwargs = engine_tuning_kwargs(
        on_gpu=True, gpu_memory_utilization=0.7, enforce_eager="true", enable_prefix_caching=False,
        max_num_seqs=256, max_num_batched_tokens=16384,
    )  # fmt: skip
    assert kwargs == {
        "gpu_memory_utilization": 0.7,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 16384,
    }
    assert engine_tuning_kwargs(on_gpu=False, enforce_eager="false")["enforce_eager"] is False
    assert engine_tuning_kwargs(on_gpu=True, enforce_eager=True)["enforce_eager"] is True  # a bool works too
    with pytest.raises(ValueError, match="enforce_eager 'maybe'"):
        engine_tuning_kwargs(on_gpu=True, enforce_eager="maybe")


class FakeLLM:
    calls: list[dict] = []

    def __init__(self, **kwargs):
        FakeLLM.calls.append(kwargs)

    def get_tokenizer(self):
        return None


@pytest.mark.parametrize("on_gpu", [False, True])
def test_the_engine_passes_the_flags_into_llm(monkeypatch, on_gpu):
    from entropy_openrlhf.actors import engine_only  # what the engine imports in its constructor: vLLM's LLM

    FakeLLM.calls = []
    monkeypatch.setattr(engine_only, "LLM", FakeLLM)
    monkeypatch.setattr(engine, "has_cuda", lambda: on_gpu)
    monkeypatch.setattr(engine, "set_cpu_defaults", lambda: None)  # leaves this process's environment alone
    rollout.RolloutEngine("/m", dtype="float32", enforce_eager="auto", max_num_seqs=96, enable_prefix_caching=False)
    (kwargs,) = FakeLLM.calls
    assert kwargs["enforce_eager"] is (not on_gpu)
    assert kwargs["gpu_memory_utilization"] == (0.9 if on_gpu else 0.8)
    assert kwargs["max_num_seqs"] == 96 and kwargs["enable_prefix_caching"] is False
    assert "max_num_batched_tokens" not in kwargs  # 0: vLLM's own default
    assert kwargs["worker_extension_cls"] == rollout.WORKER_EXTENSION and kwargs["model"] == "/m"


TUNING_FLAGS = ("gpu_memory_utilization", "enforce_eager", "enable_prefix_caching", "max_num_seqs",
                "max_num_batched_tokens")  # fmt: skip


class Started(Exception):
    pass


def test_the_trainer_hands_the_rollout_flags_to_its_rollout_group(monkeypatch):
    from entropy_openrlhf.pipeline.trainer import Trainer

    seen = {}

    def fake_init(self, model_path, **kwargs):
        seen.update(kwargs)
        raise Started  # the other groups are not this test's business

    monkeypatch.setattr(rollout.RolloutGroup, "__init__", fake_init)
    trainer = Trainer.__new__(Trainer)  # start_groups reads only cfg and model_path before the rollout group
    trainer.cfg = from_args(["--preset", "qwen2.5-32b-dapo", "--rollout.gpu_memory_utilization", "0.85"])
    trainer.model_path = "/m"
    with pytest.raises(Started):
        trainer.start_groups()
    assert seen["gpu_memory_utilization"] == 0.85
    assert seen["enforce_eager"] == "false" and seen["enable_prefix_caching"] is True
    assert seen["max_num_seqs"] == 256 and seen["max_num_batched_tokens"] == 0
    # RolloutGroup passes them on to each RolloutEngine as its **engine_kwargs; on a GPU node they become
    kwargs = engine_tuning_kwargs(on_gpu=True, **{k: seen[k] for k in TUNING_FLAGS})
    assert kwargs == {"gpu_memory_utilization": 0.85, "enforce_eager": False, "max_num_seqs": 256}


def test_from_config_passes_every_engine_setting_of_the_config(monkeypatch):
    """The trainer, scripts/evaluate.py and the weight sync benchmark start their engines through from_config: every
    argument of RolloutGroup and RolloutEngine that a flag sets comes from the config, none is left at its default."""
    import inspect

    # every keyword of the group and of its engines, but the model folder and what no flag sets
    free = {"self", "model_path", "env_vars", "engine_kwargs", "llm_kwargs"}
    params = set(inspect.signature(rollout.RolloutGroup.__init__).parameters)
    params |= set(inspect.signature(rollout.RolloutEngine.__init__).parameters)
    params = {p for p in params - free if not p.startswith("_")}  # ray.remote adds _ray_trace_ctx

    seen = {}

    def fake_init(self, model_path, **kwargs):
        seen.update(kwargs, model_path=model_path)

    monkeypatch.setattr(rollout.RolloutGroup, "__init__", fake_init)
    cfg = from_args([
        "--rollout.num_engines", "3", "--rollout.num_cpus_per_engine", "4", "--rollout.num_gpus_per_engine", "2",
        "--rollout.tensor_parallel_size", "2", "--rollout.custom_resources", '{"node_a": 1}', "--train.seed", "7",
        "--model.dtype", "bf16", "--rollout.max_model_len", "2048", "--rollout.generate_timeout_s", "99",
        "--ray.placement_timeout_s", "11", "--ray.start_timeout_s", "22", "--rollout.gpu_memory_utilization", "0.7",
        "--rollout.enforce_eager", "true", "--rollout.enable_prefix_caching", "false", "--rollout.max_num_seqs", "64",
        "--rollout.max_num_batched_tokens", "4096", "--actor.lora_rank", "16", "--rollout.mode", "partial",
        "--rollout.partial_kv", "recompute",
    ])  # fmt: skip
    rollout.RolloutGroup.from_config(cfg, "/m", env_vars={"X": "1"})
    assert seen.pop("model_path") == "/m" and seen.pop("env_vars") == {"X": "1"}  # overrides reach __init__
    assert seen == {
        "num_engines": 3, "num_cpus_per_engine": 4, "num_gpus_per_engine": 2, "tensor_parallel_size": 2,
        "custom_resources": {"node_a": 1}, "seed": 7, "dtype": "bf16", "max_model_len": 2048,
        "generate_timeout_s": 99, "placement_timeout_s": 11, "start_timeout_s": 22, "gpu_memory_utilization": 0.7,
        "enforce_eager": "true", "enable_prefix_caching": False, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
        "lora_rank": 16,  # a LoRA run's auto sync sends the adapter: the engines serve it
        "streaming": True, "partial_kv": "recompute",  # --rollout.mode partial: token-id requests, one sample each
    }  # fmt: skip
    assert set(seen) == params, params ^ set(seen)  # a new engine argument must be taken from the config here too
    # the merged sync (collective, object_store) sends whole weights: the engines serve no adapter
    cfg.sync.method = "collective"
    rollout.RolloutGroup.from_config(cfg, "/m")
    assert seen["lora_rank"] == 0
