"""`--rollout.function openrlhf_agent`: an agent file written against OpenRLHF's interface only
(rewards/examples/openrlhf_agent_retry.py) runs as it is on scripted engines: its feedback masked out like a tool
turn, the policy's ids as sampled, its rewards summed into the sample's metadata and scored by `--reward.verifier
agent`; files OpenRLHF would not run, or whose loop cannot run here, are refused by the config."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from entropy_openrlhf.actors.engine_stream import TokenRequest, TokenResult
from entropy_openrlhf.config import ConfigError, from_args, validate
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.rollouts import AgentSession, GroupRequest, get_group_rollout, load_agent
from entropy_openrlhf.samples import PromptItem
from rewards import load_verifier

ROOT = Path(__file__).resolve().parents[2]
RETRY = str(ROOT / "rewards" / "examples" / "openrlhf_agent_retry.py")
FEEDBACK = "\nThat is not right. Try again:\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tiny")))


class Engines:
    """Each request answered with the next scripted text, tokenised, then end-of-sequence; requests recorded."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tok, self.texts, self.requests, self.sampled = tokenizer, list(texts), [], []

    async def generate(self, request: TokenRequest) -> TokenResult:
        self.requests.append(request)
        text = self.texts.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"][: request.max_new_tokens - 1]
        ids.append(self.tok.eos_token_id)
        self.sampled.append(ids)
        return TokenResult(request.request_id, ids, [-0.5] * len(ids), [1] * len(ids), "stop", 0, text)


def roll(tokenizer, texts, *, max_total=0, max_turns=4):
    engines = Engines(tokenizer, texts)
    session = AgentSession(load_agent(RETRY), tokenizer, max_turns=max_turns, max_total_tokens=max_total)
    prompt = PromptItem(0, "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n", "7")
    request = GroupRequest([1, 2, 3], 1, 1.0, 1.0, 100, 5, "g0p0", tools=session)
    (sample,) = asyncio.run(get_group_rollout("openrlhf_agent")(engines, prompt, request))
    return sample, engines


def test_the_agent_file_runs_as_it_is_its_feedback_masked(tokenizer):
    s, engines = roll(tokenizer, ["It is 8", "It is 7"])
    first, second = engines.sampled
    feedback = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    assert s.prompt_token_ids == [1, 2, 3]  # reset kept the prompt: its ids as the producer tokenised them
    assert s.response_token_ids == first + feedback + second
    assert s.response_mask == [1] * len(first) + [0] * len(feedback) + [1] * len(second)
    assert s.rollout_log_probs == [-0.5] * len(first) + [0.0] * len(feedback) + [-0.5] * len(second)
    assert s.token_turns == [1] * len(first) + [0] * len(feedback) + [2] * len(second)
    assert engines.requests[1].prompt_token_ids == [1, 2, 3] + first + feedback
    assert s.metadata["agent_reward"] == 1.0 and s.metadata["agent_logs"] == {"tries": 2.0}
    assert s.response == "It is 7"
    verdict = load_verifier("agent").score([(s.response, s.label, s.prompt, s.metadata)], 5.0)[0]
    assert verdict["reward"] == 1.0 and verdict["acc"]
    s.check("openrlhf_agent")


def test_done_at_once_and_the_limits(tokenizer):
    s, engines = roll(tokenizer, ["It is 7"])
    assert len(engines.requests) == 1 and all(s.response_mask) and s.metadata["agent_reward"] == 1.0
    wrong, _ = roll(tokenizer, ["8", "9"])  # two wrong tries: done, nothing earned
    assert wrong.metadata["agent_reward"] == 0.0 and wrong.metadata["agent_score"] == 0.0
    assert not load_verifier("agent").score([(wrong.response, "7", "", wrong.metadata)], 5.0)[0]["acc"]
    # a budget the feedback does not fit in: the episode ends there, cut
    first = len(tokenizer("It is 8", add_special_tokens=False)["input_ids"]) + 1
    cut, engines = roll(tokenizer, ["It is 8", "It is 7"], max_total=first + 3)
    assert len(engines.requests) == 1 and cut.finish_reason == "length" and all(cut.response_mask)
    # --tools.max_turns bounds the steps of an agent that never says done
    capped, engines = roll(tokenizer, ["8", "7"], max_turns=0)
    assert len(engines.requests) == 1


def test_the_config_takes_an_agent_file_and_refuses_what_cannot_run(tmp_path):
    flags = ["--rollout.function", "openrlhf_agent", "--rollout.mode", "stream"]
    validate(from_args([*flags, "--rollout.agent_file", RETRY]))
    with pytest.raises(ConfigError, match="rollout.agent_file: '': no such Python file"):
        validate(from_args(flags))
    cases = {
        "broken.py": ("raise RuntimeError('boom')", "cannot load it \\(RuntimeError: boom\\)"),
        "no_agent.py": ("x = 1", "defines no AgentInstance class"),
        "own_loop.py": (
            "from openrlhf.utils.agent import AgentExecutorBase\n"
            "class AgentExecutor(AgentExecutorBase):\n"
            "    async def execute(self, *args, **kwargs):\n        pass\n",
            "has an execute of its own",
        ),
    }
    for name, (code, needle) in cases.items():
        (tmp_path / name).write_text(code)
        with pytest.raises(ConfigError, match=needle):
            validate(from_args([*flags, "--rollout.agent_file", str(tmp_path / name)]))
    with pytest.raises(ConfigError, match="--rollout.mode stream"):
        validate(from_args(["--rollout.function", "openrlhf_agent", "--rollout.agent_file", RETRY]))
