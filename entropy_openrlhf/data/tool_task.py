"""The built-in task for tool rollouts (`--data.builtin_task arith_tools`, the default with `--rollout.function
python_tool`): arith_task.py's problems and splits, asked with a prompt that shows how to run Python.

The prompt is a system message stating the call format, two worked examples as earlier turns (a fenced ```python
block that prints the result, the tool's output as a `tool` turn, then the boxed answer), then the question:

    system     Solve the math word problem. To compute, write one ```python block that prints the result ...
    user       A farm had 128 eggs. It sold 47 of them. How many eggs are left on the farm?
    assistant  ```python\\nprint(128 - 47)\\n```
    tool       81
    assistant  \\boxed{81}
    ...
    user       <the question>

The examples use numbers no level draws (three-digit, two-digit products), so neither split holds them. Level 4
(two-digit with two-digit addition and subtraction) is where a call pays: SmolLM2-135M-Instruct boxes the right
number about 2% of the time by hand (arith_task.py), while `print(a + b)` is always right.

`arith_tools_prefilled` starts each prompt's assistant turn with the call that computes its answer, so the episode
runs it before the first generation (rollouts/python_tool.py): a smoke test's way to give a tiny random model, which
never writes a code block of its own, episodes with a real tool turn. It teaches nothing: the answer is in the tool's
output.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from entropy_openrlhf.data.arith_task import _EXAMPLE_KEYS, DEFAULT_LEVELS, LEVELS, _problem, in_test_split, write_jsonl

TASKS = ("arith", "arith_tools", "arith_tools_prefilled")

TOOL_SYSTEM_PROMPT = (
    "Solve the math word problem. To compute, write one ```python block that prints the result, and stop: its "
    "output comes back to you. Then write the final answer as a number inside \\boxed{}, exactly like the examples."
)
# (question, the expression the call prints, its value)
TOOL_EXAMPLES = [
    ("A farm had 128 eggs. It sold 47 of them. How many eggs are left on the farm?", "128 - 47", 81),
    ("A class has 23 rows with 17 chairs in each row. How many chairs are there in all?", "23 * 17", 391),
]


def call(expression: str) -> str:
    """The fenced call that prints `expression`, as the examples write it."""
    return f"```python\nprint({expression})\n```\n"


def build_tool_prompt(question: str) -> list[dict[str, str]]:
    """System message, the worked examples with their tool turns, then the question."""
    messages = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}]
    for example, expression, answer in TOOL_EXAMPLES:
        messages += [
            {"role": "user", "content": example},
            {"role": "assistant", "content": call(expression)},
            {"role": "tool", "content": str(answer)},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
        ]
    messages.append({"role": "user", "content": question})
    return messages


def expression(key: tuple) -> str:
    """The Python expression of a problem's arithmetic key (arith_task.py's keys)."""
    _, op, *numbers = key
    if op == "+-":
        a, b, c = numbers
        return f"{a} + {b} - {c}"
    return f" {'*' if op == '*' else op} ".join(str(n) for n in numbers)


def generate(
    n: int, *, split: str = "train", seed: int = 0, levels: Sequence[int] = DEFAULT_LEVELS, prefill: bool = False
) -> list[dict[str, Any]]:
    """`n` rows of `split`, as arith_task.generate draws them (the same problems for a seed), with the tool prompt;
    `prefill`: each prompt ends with an assistant turn holding the call that computes the answer."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, not {list(levels)}")
    rng = random.Random(f"arith-{split}-{seed}")
    rows = []
    for i in range(n):
        level = levels[i % len(levels)]
        while True:
            key, question, answer = _problem(rng, level)
            if in_test_split(key) == (split == "test") and key not in _EXAMPLE_KEYS:
                break
        prompt = build_tool_prompt(question)
        if prefill:
            prompt.append({"role": "assistant", "content": call(expression(key))})
        rows.append({"prompt": prompt, "label": str(answer), "data_source": f"arith_l{level}", "level": level})
    return rows


def write_tool_task(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_train: int = 2000,
    n_test: int = 300,
    levels: Sequence[int] = DEFAULT_LEVELS,
    prefill: bool = False,
) -> tuple[str, str]:
    """Write `arith_tools[_prefilled]_{train,test}.jsonl` into `out_dir`; return their paths."""
    out_dir, name = Path(out_dir), "arith_tools_prefilled" if prefill else "arith_tools"
    train = generate(n_train, split="train", seed=seed, levels=levels, prefill=prefill)
    test = generate(n_test, split="test", seed=seed, levels=levels, prefill=prefill)
    return str(write_jsonl(train, out_dir / f"{name}_train.jsonl")), str(
        write_jsonl(test, out_dir / f"{name}_test.jsonl")
    )
