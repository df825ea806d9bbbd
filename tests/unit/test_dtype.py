"""The one dtype rule of the policy, the reference and the vLLM engines (models/dtype.py)."""

import json

import pytest
import torch

from entropy_openrlhf.actors import engine as rollout
from entropy_openrlhf.actors import policy_engine as policy
from entropy_openrlhf.actors import reference_model as reference
from entropy_openrlhf.models import dtype
from entropy_openrlhf.models.dtype import resolve_dtype, vllm_dtype


def checkpoint(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_is_fp32_on_cpu_whatever_the_checkpoint_saved(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = checkpoint(tmp_path, torch_dtype="bfloat16")
    assert resolve_dtype("auto", path) is torch.float32
    assert vllm_dtype("auto", path) == "float32"  # never vLLM's own auto, which would make it bf16


@pytest.mark.parametrize("name", ["bf16", "bfloat16"])
def test_explicit_bf16(name, tmp_path):
    assert resolve_dtype(name, str(tmp_path)) is torch.bfloat16
    assert vllm_dtype(name, str(tmp_path)) == "bfloat16"


@pytest.mark.parametrize("name", ["fp32", "float32"])
def test_explicit_fp32_even_on_gpu_with_a_bf16_checkpoint(name, gpu, tmp_path):
    path = checkpoint(tmp_path, torch_dtype="bfloat16")
    assert resolve_dtype(name, path) is torch.float32
    assert vllm_dtype(name, path) == "float32"


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5 writes "dtype"
        ({"text_config": {"dtype": "bfloat16"}}, torch.bfloat16),  # multimodal configs nest it
        ({"torch_dtype": "float32"}, torch.float32),
        ({"torch_dtype": "float16"}, torch.float32),  # no fp16 loss scaling in the trainer: fp32 on both sides
        ({}, torch.float32),
    ],
)
def test_auto_on_gpu_is_the_checkpoints_dtype(gpu, tmp_path, config, expected):
    path = checkpoint(tmp_path, **config)
    assert resolve_dtype("auto", path) is expected
    assert vllm_dtype("auto", path) == str(expected).removeprefix("torch.")


def test_auto_on_gpu_without_config_json_is_fp32(gpu, tmp_path):
    assert resolve_dtype("auto", str(tmp_path / "missing")) is torch.float32


def test_unknown_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype 'fp16'"):
        resolve_dtype("fp16", str(tmp_path))


def test_every_model_copy_uses_the_one_rule():
    assert policy.resolve_dtype is dtype.resolve_dtype and reference.resolve_dtype is dtype.resolve_dtype
    assert rollout.vllm_dtype is dtype.vllm_dtype
