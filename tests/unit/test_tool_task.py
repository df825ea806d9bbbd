"""The built-in task for tool rollouts: arith_task's problems and splits with a prompt that shows the call format, the
prefilled variant whose prompts end with the call that computes the answer, and how the loader and the run pick
them."""

import json

import pytest
from transformers import AutoTokenizer

from entropy_openrlhf.config import from_args
from entropy_openrlhf.data import arith_task, tool_task
from entropy_openrlhf.data.dataset import load_prompts
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.pipeline.run import resolve_data
from entropy_openrlhf.rollouts.tool_turns import tool_call
from entropy_openrlhf.tools.sandbox import run_python


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_the_same_problems_and_splits_as_the_arithmetic_task():
    for split in ("train", "test"):
        plain = arith_task.generate(40, split=split, seed=3, levels=(3, 4))
        tools = tool_task.generate(40, split=split, seed=3, levels=(3, 4))
        assert [r["label"] for r in tools] == [r["label"] for r in plain]
        assert [r["prompt"][-1] for r in tools] == [r["prompt"][-1] for r in plain]  # the question
        assert tools[0]["prompt"][0] == {"role": "system", "content": tool_task.TOOL_SYSTEM_PROMPT}
        assert {"role": "tool", "content": "81"} in tools[0]["prompt"]  # a worked example's tool turn


def test_the_worked_examples_are_in_no_split():
    answers = {answer for _, _, answer in tool_task.TOOL_EXAMPLES}
    rows = tool_task.generate(300, split="train", levels=(4,)) + tool_task.generate(300, split="test", levels=(4,))
    questions = {r["prompt"][-1]["content"] for r in rows}
    assert not questions & {q for q, _, _ in tool_task.TOOL_EXAMPLES}
    assert all(int(r["label"]) < 200 for r in rows) and max(answers) > 200  # no level reaches the examples' numbers


def test_a_prefilled_prompt_ends_with_the_call_that_computes_its_answer(tokenizer, tmp_path):
    rows = tool_task.generate(12, split="train", seed=1, levels=(1, 2, 3, 4), prefill=True)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items = load_prompts(str(path), tokenizer=tokenizer)
    for row, item in zip(rows, items):
        assert row["prompt"][-1]["role"] == "assistant"
        code = tool_call(item.prompt)  # the loader continued the assistant turn: the prompt ends with the call
        assert code is not None and item.prompt.endswith("```\n")
        assert run_python(code, timeout_s=5, memory_mb=256, sandbox="none").stdout.strip() == row["label"]
    unfilled = tool_task.generate(2, prefill=False)
    path.write_text("\n".join(json.dumps(r) for r in unfilled))
    assert all(tool_call(i.prompt) is None for i in load_prompts(str(path), tokenizer=tokenizer))


@pytest.mark.parametrize(
    "flags, name",
    [
        ([], "arith_train.jsonl"),
        (["--rollout.function", "python_tool", "--rollout.mode", "stream"], "arith_tools_train.jsonl"),
        (["--data.builtin_task", "arith_tools_prefilled"], "arith_tools_prefilled_train.jsonl"),
    ],
)
def test_the_run_picks_the_task_for_its_rollout_function(tmp_path, flags, name):
    cfg = from_args(["--train.output_dir", str(tmp_path), *flags])
    train, tests = resolve_data(cfg)
    assert train.endswith(name) and tests == [train.replace("_train", "_test")]
