"""Countdown (as in TinyZero): reach a target with the given numbers, each used exactly once, and + - * / ( ).

The response ends with `<answer>(25 - 5) * 3</answer>`. The label is JSON, `{"target": 60, "numbers": [3, 5, 25]}`,
or the target alone with the numbers in `metadata["numbers"]`.

Rewards follow TinyZero: 1.0 for a correct equation, 0.1 for a well-formed but wrong one, 0 without an answer.
Plug in with `--reward.verifier countdown` or `rewards.examples.countdown:countdown_verifier`.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections import Counter
from typing import Any

FORMAT_REWARD = 0.1
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED = re.compile(r"[\d+\-*/().\s]+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def parse_label(label: Any, metadata: dict[str, Any] | None) -> tuple[float, list[int]]:
    if isinstance(label, str) and label.strip().startswith("{"):
        label = json.loads(label)
    if isinstance(label, dict):
        return float(label["target"]), [int(x) for x in label["numbers"]]
    numbers = (metadata or {}).get("numbers")
    if numbers is None:
        raise ValueError("countdown needs the numbers: a JSON label {target, numbers} or metadata['numbers']")
    return float(label), [int(x) for x in numbers]


def evaluate(equation: str) -> float:
    """Value of an arithmetic expression; only numbers, + - * / and parentheses (no eval of arbitrary code)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not allowed in an equation: {ast.dump(node)[:60]}")

    return walk(ast.parse(equation, mode="eval"))


def countdown_verifier(
    response: str, label: Any, *, prompt: str = "", metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    target, numbers = parse_label(label, metadata)
    answers = _ANSWER.findall(response)
    if not answers:
        return {"reward": 0.0, "acc": False, "format_ok": False, "equation": ""}
    equation = answers[-1].strip()
    out = {"reward": FORMAT_REWARD, "acc": False, "format_ok": True, "equation": equation}
    if not _ALLOWED.fullmatch(equation):
        return out
    # each given number exactly once; the model may not invent numbers
    if Counter(int(x) for x in re.findall(r"\d+", equation)) != Counter(numbers):
        return out
    try:
        value = evaluate(equation)
    except (ValueError, SyntaxError, ZeroDivisionError):
        return out
    if abs(value - target) < 1e-5:
        out.update(reward=1.0, acc=True)
    return out
