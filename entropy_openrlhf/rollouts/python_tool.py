"""`--rollout.function python_tool`: multi-turn episodes in which the policy runs Python in the sandbox.

One episode per sample. The engine generates until the end of a tool call (a fenced ```python block, tool_turns.py)
or end-of-sequence; the call runs in the sandbox pool (tools/pool.py, which never raises for what the code does); its
output comes back as a tool turn; generation goes on from there. At most `--tools.max_turns` calls are made, the
generation after the last one without the stop string; each generation is at most `--rollout.max_new_tokens`, and the
response, policy and tool turns together, stays within `--tools.max_total_tokens` (0: `--rollout.max_new_tokens`).
An episode whose next tool turn would not fit ends there, cut (`finish_reason` "length", so `--loss.mask_truncated`
applies to it). A prompt that itself ends with a tool call (a chat prompt whose last message is an assistant turn
holding one: the dataset's prefill) has that call run before the first generation; it counts as a call, and the
policy's first tokens, after its output, are turn 2.

Token in, token out: every request is the prompt's ids plus the response's ids so far, exactly as sampled; only the
tool turns are tokenised. The sample's `response_mask` is 1 on the policy's tokens and 0 on every tool-turn token,
delimiters included; `rollout_log_probs` is 0.0 on the masked tokens (nothing reads it there: the mask takes them out
of the loss, the covariance selection, the off-policy weights and every metric), and `token_versions` repeats the
version of the policy token before them (after them, for a prefilled call's output). `token_turns` numbers the
policy's turns (1, 2, ...; 0 on tool tokens), for the per-turn entropy metrics.

What the verifier judges is the final answer: `response` is the text of the policy's last turn. The whole episode,
decoded with its special tokens, is `metadata["transcript"]`, and its counts are `metadata["tool_episode"]` (a
verifier sees both). `--tools.error_penalty` subtracts a fixed amount from the reward per failed call
(`apply_error_penalty`, in training only).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from entropy_openrlhf.actors.engine_stream import TokenRequest
from entropy_openrlhf.rollouts.base import GroupRequest, TokenEngines, register_group_rollout
from entropy_openrlhf.rollouts.tool_turns import STOP, ToolTurns, observation, tool_call
from entropy_openrlhf.samples import PromptItem, Sample


@dataclass
class ToolSession:
    """What a tool episode needs beyond the engines; the trainer puts one in every `GroupRequest.tools`.
    `pool`: anything with `async run(code, stdin="") -> SandboxResult` (tools/pool.py's ToolPool in a run)."""

    pool: Any
    tokenizer: Any
    max_turns: int = 4
    max_total_tokens: int = 0  # 0: the request's max_new_tokens
    max_model_len: int = 0  # the engine's limit on prompt + response; 0: none to respect
    turns: ToolTurns = field(init=False)

    def __post_init__(self) -> None:
        self.turns = ToolTurns(self.tokenizer)

    @classmethod
    def from_config(cls, cfg: Any, pool: Any, tokenizer: Any) -> ToolSession:
        """`cfg`: the run's Config (not imported: the config imports this package, for --rollout.function)."""
        t = cfg.tools
        return cls(pool, tokenizer, t.max_turns, t.max_total_tokens, cfg.rollout.max_model_len)


@register_group_rollout("python_tool")
async def python_tool_group(engines: TokenEngines, prompt: PromptItem, request: GroupRequest) -> list[Sample]:
    """The group's n episodes, all at once (module docstring)."""
    session = request.tools
    if not isinstance(session, ToolSession):
        raise ValueError(
            "--rollout.function python_tool: the group request carries no ToolSession (GroupRequest.tools); the "
            "trainer gives one to runs whose rollout function uses tools (Config.uses_tools)"
        )
    return list(await asyncio.gather(*(_episode(engines, session, prompt, request, j) for j in range(request.n))))


def _seed(seed: int | None, part: int) -> int | None:
    """The seed of an episode's `part`-th request: its first is the sample's own (what single_turn sends)."""
    if seed is None or part == 0:
        return seed
    return (seed * 1_000_033 + part * 7_919) % 2**62


async def _episode(
    engines: TokenEngines, session: ToolSession, prompt: PromptItem, request: GroupRequest, j: int
) -> Sample:
    tok = session.tokenizer
    chat = prompt.messages is not None
    budget = session.max_total_tokens or request.max_new_tokens
    seed = None if request.seed is None else request.seed + j
    ids: list[int] = []
    mask: list[int] = []
    log_probs: list[float] = []
    versions: list[int] = []
    turns: list[int] = []
    counts = {"calls": 0, "errors": 0, "timeouts": 0, "seconds": 0.0, "turns": 1, "tool_tokens": 0}
    turn, part, stale, text, finish = 1, 0, 0, "", "length"
    # a prompt that ends with a tool call (an assistant turn the dataset started, a prefill) has it run first
    code, ended_with = tool_call(prompt.prompt), None
    while True:
        if code is not None:
            result = await session.pool.run(code)
            counts["calls"] += 1
            counts["errors"] += not result.ok
            counts["timeouts"] += result.timed_out
            counts["seconds"] += result.seconds
            tool = session.turns.ids(observation(result), chat=chat, ended_with=ended_with)
            if len(ids) + len(tool) >= budget:  # no room for the output and a token after it
                finish = "length"
                break
            ids += tool
            mask += [0] * len(tool)
            log_probs += [0.0] * len(tool)
            versions += [-1] * len(tool)  # a tool token's version is its neighbour's (below)
            turns += [0] * len(tool)
            counts["tool_tokens"] += len(tool)
            turn, text, code = turn + 1, "", None
        room = min(request.max_new_tokens, budget - len(ids))  # per generation, and what the episode has left
        if session.max_model_len:
            room = min(room, session.max_model_len - len(request.prompt_token_ids) - len(ids))
        if room <= 0:
            finish = "length"
            break
        may_call = counts["calls"] < session.max_turns
        r = await engines.generate(
            TokenRequest(
                f"{request.tag}-{j}-{part}",
                list(request.prompt_token_ids) + ids,
                room,
                request.temperature,
                request.top_p,
                _seed(seed, part),
                stop=(STOP,) if may_call else (),
            )  # fmt: skip
        )
        part += 1
        n = len(r.token_ids)
        ids += r.token_ids
        mask += [1] * n
        log_probs += r.log_probs
        versions += r.versions
        turns += [turn] * n
        stale += r.stale_kv_tokens
        text += r.text
        finish = r.finish_reason
        if finish != "stop" or not may_call or n == 0:
            break
        at_fence = text.endswith(STOP)  # the stop string ended the request, not end-of-sequence
        code = tool_call(text)
        if code is None:
            if at_fence:
                continue  # a fence that closed something else: the same turn goes on
            break  # end of sequence with no call: the final answer
        ended_with = None if at_fence else tok.decode(r.token_ids[-1:], skip_special_tokens=False)
    counts["turns"] = max(turns, default=1)  # the policy's turns that hold a token
    versions = _neighbour_versions(versions)
    transcript = tok.decode(ids, skip_special_tokens=False)
    counts["drift"] = tok(transcript, add_special_tokens=False)["input_ids"] != ids
    return Sample(
        prompt_index=prompt.index,
        prompt=prompt.prompt,
        prompt_token_ids=list(request.prompt_token_ids),
        response=text,
        response_token_ids=ids,
        rollout_log_probs=log_probs,
        label=prompt.label,
        policy_version=min((v for v, m in zip(versions, mask) if m), default=min(versions, default=0)),
        finish_reason=finish,
        data_source=prompt.data_source,
        metadata={**prompt.metadata, "tool_episode": counts, "transcript": transcript},
        messages=prompt.messages,
        response_mask=mask if ids else [],
        token_versions=versions,
        stale_kv_tokens=stale,
        token_turns=turns,
    )


def _neighbour_versions(versions: list[int]) -> list[int]:
    """Each tool token (-1) given the version of the policy token before it, or after it where none is before (a
    prefilled call's output): so that a tool turn neither lowers a sample's version nor adds an age of its own."""
    known = [v for v in versions if v >= 0]
    last = known[0] if known else 0
    out = []
    for v in versions:
        last = v if v >= 0 else last
        out.append(last)
    return out


def tool_metrics(samples: list[Sample]) -> dict[str, float]:
    """The batch's `tools/*` and tool-episode `rollout/*` metrics (docs/guides/metrics.md); {} without tool
    episodes."""
    episodes = [s.metadata["tool_episode"] for s in samples if "tool_episode" in s.metadata]
    if not episodes:
        return {}
    calls = sum(e["calls"] for e in episodes)
    tokens = sum(len(s.response_token_ids) for s in samples)
    return {
        "tools/calls_per_sample": calls / len(episodes),
        "tools/errors_frac": sum(e["errors"] for e in episodes) / calls if calls else 0.0,
        "tools/timeouts_frac": sum(e["timeouts"] for e in episodes) / calls if calls else 0.0,
        "tools/seconds_mean": sum(e["seconds"] for e in episodes) / calls if calls else 0.0,
        "rollout/turns_mean": sum(e["turns"] for e in episodes) / len(episodes),
        "rollout/tool_tokens_frac": sum(e["tool_tokens"] for e in episodes) / max(1, tokens),
        "rollout/retokenize_drift_frac": sum(bool(e["drift"]) for e in episodes) / len(episodes),
    }


def apply_error_penalty(samples: list[Sample], penalty: float) -> dict[str, float]:
    """`--tools.error_penalty`: subtract `penalty` from each sample's reward once per failed tool call (after the
    verifier, in training only), noted in `reward_info["tool_error_penalty"]`; the mean, as a metric ({} when off or
    without tool episodes)."""
    episodes = [(s, s.metadata.get("tool_episode")) for s in samples]
    if not penalty or not any(e for _, e in episodes):
        return {}
    shaped = []
    for s, e in episodes:
        amount = -penalty * (e["errors"] if e else 0)
        s.reward += amount
        s.reward_info["tool_error_penalty"] = amount
        shaped.append(amount)
    return {"reward/tool_error_penalty_mean": sum(shaped) / len(shaped)}
