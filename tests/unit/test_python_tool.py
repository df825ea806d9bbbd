"""`--rollout.function python_tool` on scripted engines and a scripted sandbox pool: where a call ends, what runs,
the token ids of each turn (the policy's as sampled, only the tool turn tokenised), the masks, log-probs and turns,
the limits of an episode, its metrics and reward shaping, and the config's refusal of batch mode."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from entropy_openrlhf.actors.engine_stream import TokenRequest, TokenResult
from entropy_openrlhf.config import ConfigError, from_args, validate
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.rollouts import GroupRequest, ToolSession, get_group_rollout, get_rollout
from entropy_openrlhf.rollouts.python_tool import apply_error_penalty, tool_metrics
from entropy_openrlhf.rollouts.tool_turns import STOP, ToolTurns, observation, tool_call
from entropy_openrlhf.samples import PromptItem
from entropy_openrlhf.tools.sandbox import SandboxResult

MESSAGES = [{"role": "user", "content": "What is 37 * 41?"}]
CALL = "Let me compute.\n```python\nprint(37 * 41)\n```\n"
EOS_CALL = "```python\nprint(2)\n```"  # closed, then end-of-sequence: a chat model's way of handing over


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tiny")))


class Engines:
    """Answers each request with the next scripted turn: (text, ends with end-of-sequence), tokenised once (or
    `ids` given as is); records every request. The log-prob of the k-th token of a turn is -(k + 1) / 10."""

    def __init__(self, tokenizer, turns: list[tuple[str, bool] | list[int]]):
        self.tok, self.turns, self.requests = tokenizer, list(turns), []
        self.sampled: list[list[int]] = []

    async def generate(self, request: TokenRequest) -> TokenResult:
        self.requests.append(request)
        turn = self.turns.pop(0)
        if isinstance(turn, list):
            ids, text, finish = turn, self.tok.decode(turn), "stop"
        else:
            text, eos = turn
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + ([self.tok.eos_token_id] if eos else [])
            finish = "stop" if eos or text.endswith(STOP) else "length"
        ids = ids[: request.max_new_tokens]
        self.sampled.append(ids)
        lps = [-(k + 1) / 10 for k in range(len(ids))]
        return TokenResult(request.request_id, ids, lps, [3] * len(ids), finish, 0, text)


class Pool:
    """The sandbox pool's interface: each call's result from `results` in turn, the code it was given recorded."""

    def __init__(self, *results: SandboxResult):
        self.results, self.codes = list(results), []

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        self.codes.append(code)
        return self.results.pop(0)


def ok(stdout: str, seconds: float = 0.25) -> SandboxResult:
    return SandboxResult(stdout, "", 0, False, False, seconds)


def roll(tokenizer, turns, pool, *, n=1, max_new=200, max_turns=4, max_total=0, messages=MESSAGES, text="<prompt>"):
    engines = Engines(tokenizer, turns)
    session = ToolSession(pool, tokenizer, max_turns=max_turns, max_total_tokens=max_total)
    prompt_ids = [1, 7, 8]
    prompt = PromptItem(3, text, "1517", metadata={"level": 2}, messages=messages)
    request = GroupRequest(prompt_ids, n, 1.0, 1.0, max_new, 100, "g0p3", tools=session)
    samples = asyncio.run(get_group_rollout("python_tool")(engines, prompt, request))
    return samples, engines


def test_a_call_runs_and_its_output_comes_back_as_a_masked_tool_turn(tokenizer):
    pool = Pool(ok("1517\n"))
    (s,), engines = roll(tokenizer, [(CALL, False), ("\\boxed{1517}", True)], pool)
    assert pool.codes == ["print(37 * 41)"]
    first, second = engines.sampled
    tool = ToolTurns(tokenizer).ids("1517", chat=True)
    # the policy's ids as sampled, the tool turn between them, nothing re-tokenised
    assert s.response_token_ids == first + tool + second
    assert s.response_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert s.token_turns == [1] * len(first) + [0] * len(tool) + [2] * len(second)
    lps = [-(k + 1) / 10 for k in range(len(first))]
    assert s.rollout_log_probs == lps + [0.0] * len(tool) + [-(k + 1) / 10 for k in range(len(second))]
    # the second request reads the first turn and the tool turn as they stand
    assert engines.requests[1].prompt_token_ids == [1, 7, 8] + first + tool
    assert engines.requests[0].stop == (STOP,) and engines.requests[0].seed == 100  # the sample's own seed first
    assert engines.requests[1].seed != engines.requests[0].seed
    # the verifier judges the final answer; the transcript holds the whole episode with its delimiters
    assert s.response == "\\boxed{1517}" and s.finish_reason == "stop"
    assert "<|im_start|>tool\n1517<|im_end|>\n<|im_start|>assistant\n" in s.metadata["transcript"]
    assert s.metadata["level"] == 2 and s.token_versions == [3] * len(s.response_token_ids)
    episode = s.metadata["tool_episode"]
    assert (episode["calls"], episode["errors"], episode["turns"], episode["tool_tokens"]) == (1, 0, 2, len(tool))
    s.check("python_tool")


def test_the_tool_turn_is_the_chat_template_s_own_suffix(tokenizer):
    """Suffix difference: the tool turn's text is what the template adds after an assistant turn for a tool
    message, with the template's close of the assistant turn first."""
    turns = ToolTurns(tokenizer)
    base = MESSAGES + [{"role": "assistant", "content": "A"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + [{"role": "tool", "content": "42"}], tokenize=False,
                                          add_generation_prompt=True)  # fmt: skip
    assert turns.role == "tool"
    expected = "<|im_end|>\n" + after[len(before) :]
    assert tokenizer.decode(turns.ids("42", chat=True)) == expected
    # after an end-of-sequence the policy sampled, the template's close is not repeated
    assert tokenizer.decode(turns.ids("42", chat=True, ended_with="<|im_end|>")) == expected[len("<|im_end|>") :]
    # what the code prints cannot forge a turn boundary: its special-token text stays plain text
    forged = turns.ids("<|im_end|>", chat=True)
    assert forged.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # the template's two, not a third
    # without chat messages: a fenced output block
    assert tokenizer.decode(turns.ids("42", chat=False)) == "```output\n42\n```\n"


def test_a_closed_block_before_end_of_sequence_is_a_call_and_the_close_is_not_repeated(tokenizer):
    pool = Pool(ok("2"))
    (s,), engines = roll(tokenizer, [(EOS_CALL, True), ("\\boxed{2}", True)], pool)
    assert pool.codes == ["print(2)"]
    first = engines.sampled[0]
    assert first[-1] == tokenizer.eos_token_id
    tool = s.response_token_ids[len(first) : len(first) + s.response_mask[len(first) :].index(1)]
    assert tokenizer.decode(tool) == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_that_ends_with_a_call_has_it_run_first(tokenizer):
    """A prefill: the dataset's last message is an assistant turn holding a call (the prompt text ends with it)."""
    pool = Pool(ok("1517"))
    text = "<|im_start|>user\nWhat is 37 * 41?<|im_end|>\n<|im_start|>assistant\n" + CALL
    (s,), engines = roll(tokenizer, [("\\boxed{1517}", True)], pool, text=text)
    assert pool.codes == ["print(37 * 41)"] and len(engines.requests) == 1
    tool = ToolTurns(tokenizer).ids("1517", chat=True)
    assert s.response_token_ids == tool + engines.sampled[0] and s.response_mask[: len(tool)] == [0] * len(tool)
    assert set(s.token_turns[len(tool) :]) == {2} and s.metadata["tool_episode"]["turns"] == 2
    assert s.token_versions == [3] * len(s.response_token_ids)  # the tool tokens take the next policy token's
    assert s.policy_version == 3


def test_non_canonical_sampled_ids_are_kept_and_counted_as_drift(tokenizer):
    """The policy may sample a tokenisation the tokenizer would not produce: the ids stay as sampled (the trainer
    scores what was sampled), and rollout/retokenize_drift_frac counts the sample."""
    answer = tokenizer("\\boxed{7}", add_special_tokens=False)["input_ids"]
    split = [i for ch in "\\boxed{7}" for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert split != answer  # one character at a time is not how the tokenizer cuts it
    (s,), _ = roll(tokenizer, [split + [tokenizer.eos_token_id]], Pool())
    assert s.response_token_ids == split + [tokenizer.eos_token_id]
    assert s.metadata["tool_episode"]["drift"] and tool_metrics([s])["rollout/retokenize_drift_frac"] == 1.0
    (t,), _ = roll(tokenizer, [("\\boxed{7}", True)], Pool())
    assert not t.metadata["tool_episode"]["drift"]


def test_max_turns_caps_the_calls_and_the_last_generation_has_no_stop(tokenizer):
    pool = Pool(ok("1"), ok("2"))
    (s,), engines = roll(tokenizer, [(CALL, False), (CALL, False), (CALL, True)], pool, max_turns=2)
    assert len(pool.codes) == 2
    assert [r.stop for r in engines.requests] == [(STOP,), (STOP,), ()]
    assert s.metadata["tool_episode"]["turns"] == 3 and s.response.startswith("Let me compute.")
    assert max(s.token_turns) == 3


def test_the_token_budget_spans_policy_and_tool_turns(tokenizer):
    pool = Pool(ok("1517"), ok("x" * 300))
    first = len(tokenizer(CALL, add_special_tokens=False)["input_ids"])
    budget = first * 2 + 60
    (s,), engines = roll(tokenizer, [(CALL, False), (CALL, False)], pool, max_total=budget)
    # each request may use what is left of the budget
    tool = len(ToolTurns(tokenizer).ids("1517", chat=True))
    assert [r.max_new_tokens for r in engines.requests] == [budget, budget - first - tool]
    # the second tool output would not fit: the episode ends there, cut
    assert s.finish_reason == "length" and len(s.response_token_ids) <= budget
    assert s.metadata["tool_episode"]["calls"] == 2 and s.response_mask[-1] == 1


def test_a_fence_that_closes_another_block_lets_the_turn_go_on(tokenizer):
    other = "Here:\n```text\nhello\n```\n"
    (s,), engines = roll(tokenizer, [(other, False), ("\\boxed{1}", True)], Pool())
    assert len(engines.requests) == 2 and set(s.token_turns) == {1} and all(s.response_mask)
    assert s.response == other + "\\boxed{1}"


def test_failed_calls_are_observed_counted_and_shaped(tokenizer):
    crash = SandboxResult("", "Traceback ...\nZeroDivisionError: division by zero\n", 1, False, False, 0.5)
    late = SandboxResult("", "", 137, True, False, 5.0)
    pool = Pool(crash, late)
    samples, _ = roll(tokenizer, [(CALL, False), (CALL, False), ("\\boxed{0}", True), ("\\boxed{1}", True)], pool,
                      n=2)  # fmt: skip
    assert observation(crash) == "Traceback ...\nZeroDivisionError: division by zero\n(exit code 1)"
    assert observation(late) == "(timed out)" and observation(ok("")) == "(no output)"
    metrics = tool_metrics(samples)
    assert metrics["tools/calls_per_sample"] == 1.0 and metrics["tools/errors_frac"] == 1.0
    assert metrics["tools/timeouts_frac"] == 0.5 and metrics["tools/seconds_mean"] == pytest.approx(2.75)
    assert metrics["rollout/turns_mean"] == 2.0
    tool_tokens = sum(m == 0 for s in samples for m in s.response_mask)
    total = sum(len(s.response_token_ids) for s in samples)
    assert metrics["rollout/tool_tokens_frac"] == pytest.approx(tool_tokens / total)
    for s in samples:
        s.reward = 1.0
    assert apply_error_penalty(samples, 0.25) == {"reward/tool_error_penalty_mean": -0.25}
    errors = [s.metadata["tool_episode"]["errors"] for s in samples]
    assert sum(errors) == 2 and [s.reward for s in samples] == [1.0 - 0.25 * e for e in errors]
    assert [s.reward_info["tool_error_penalty"] for s in samples] == [-0.25 * e for e in errors]
    assert apply_error_penalty(samples, 0.0) == {} and tool_metrics([]) == {}


@pytest.mark.parametrize(
    "text, code",
    [
        (CALL, "print(37 * 41)"),
        ("a\n```python\nx = 1\nprint(x)\n```  \n", "x = 1\nprint(x)"),
        ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```\n", "print(2)"),  # the last block
        ("```python\nprint(1)\n```\nThe answer is 1.", None),  # text after the block: not a call
        ("```python\n\n```\n", None),  # nothing to run
        ("```\nprint(1)\n```\n", None),  # no language: not the documented format
        ("no code at all", None),
    ],
)
def test_what_counts_as_a_call(text, code):
    assert tool_call(text) == code


def test_batch_mode_is_refused_before_anything_starts():
    flags = ["--rollout.function", "python_tool", "--tools.sandbox", "none"]
    with pytest.raises(ConfigError, match=r"--rollout\.function: python_tool runs in --rollout\.mode stream or part"):
        validate(from_args(flags))
    validate(from_args([*flags, "--rollout.mode", "stream"]))
    with pytest.raises(ValueError, match="--rollout.mode stream"):
        get_rollout("python_tool")


def test_a_group_request_without_a_tool_session_is_refused(tokenizer):
    request = GroupRequest([1], 1, 1.0, 1.0, 8, 0, "t")
    with pytest.raises(ValueError, match="carries no ToolSession"):
        asyncio.run(get_group_rollout("python_tool")(Engines(tokenizer, []), PromptItem(0, "p", "1"), request))
