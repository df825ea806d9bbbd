"""Tiny random Llama models with a real tokenizer, made in a folder in well under a second.

Tests and `--preset smoke` use them: the whole pipeline (vLLM, DeepSpeed, weight sync) runs on a few-MB model.
hidden size 64 with one 64-wide head, because the vLLM CPU attention kernel rejects head_dim < 64; fp32, because
bf16 two-layer models crash the AMX attention kernel on short prompts (docs/guides/cpu.md, 'bf16 and AMX').
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    lines = []
    for a in range(0, 60, 3):
        for b in range(0, 40, 7):
            lines.append(f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}.")
            lines.append(f"Tom has {a} apples and gets {b} more. Answer: {a + b}")
    lines += ["system user assistant Solve the problem. Put the final answer in \\boxed{}."] * 5
    return lines


def make_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama (fp32 safetensors) and its tokenizer to `path`; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    return path
