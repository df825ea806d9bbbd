"""`--rollout.function openrlhf_agent --rollout.agent_file path.py`: an OpenRLHF agent file, run as it is.

The file is what OpenRLHF's `--train.agent_func_path` takes: an `AgentInstance` class (OpenRLHF's
`AgentInstanceBase`) with async `reset(states)` and `step(states)`, and usually an `AgentExecutor` that hands it to
OpenRLHF's `MultiTurnAgentExecutor`. Each episode runs that executor's loop over the streaming engines, token in and
token out:

- `reset({"observation": prompt, "label": label})` gives the first observation. When it is the prompt unchanged, its
  ids are the prompt's, already tokenised; otherwise it is tokenised once, as OpenRLHF does.
- Then, in turns: the engine generates the action (until end-of-sequence or the token budget);
  `step({"observation_text", "action_text", "label", "sampling_params"})` returns `rewards`, `environment_feedback`,
  `done` and optionally `scores` and `extra_logs`; the feedback text is tokenised alone and appended with
  `response_mask` 0, as a tool turn is, and `rollout_log_probs` 0.0 (after the last step too, as in OpenRLHF).
- The episode ends when `step` says `done`, when the response reaches `--tools.max_total_tokens` (0:
  `--rollout.max_new_tokens`), or after `--tools.max_turns` + 1 steps (a bound OpenRLHF leaves to the agent). Each
  action is at most `--rollout.max_new_tokens` (OpenRLHF gives an action all the budget left).

The episode's reward is the sum of its steps' `rewards`, as in OpenRLHF, kept in `metadata["agent_reward"]` (the last
step's `scores` in `metadata["agent_score"]`); `--reward.verifier agent` makes it the sample's reward. The verifier
sees the last action as `response`. `sampling_params` is a plain object holding the run's settings (temperature,
top_p, max_tokens); changed ones returned by `step` are not followed: the trainer scores every token at
`--rollout.temperature`.

The agent's code runs in the trainer's driver process, in the streaming producer's event loop, with the trainer's
permissions: it is the user's code, not the model's, and it is not sandboxed. An agent that runs what the model
wrote should do it through the sandbox (entropy_openrlhf.tools.run_python). A file whose `AgentExecutor` overrides
`execute` (a loop of its own over OpenRLHF's engine) is refused: that loop cannot run on these engines.
"""

from __future__ import annotations

import asyncio
import importlib.util
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from entropy_openrlhf.actors.engine_stream import TokenRequest
from entropy_openrlhf.rollouts.base import GroupRequest, TokenEngines, register_group_rollout
from entropy_openrlhf.samples import PromptItem, Sample

STEP_TIMEOUT_S = 600.0  # how long one reset or step of the agent may take


@cache
def load_agent(path: str) -> type:
    """The `AgentInstance` class of the OpenRLHF agent file at `path` (loaded once). Raises ValueError naming the
    flag and what is wrong."""
    where = f"--rollout.agent_file {path}"
    if not path.endswith(".py") or not Path(path).is_file():
        raise ValueError(f"{where}: no such Python file")
    spec = importlib.util.spec_from_file_location(f"openrlhf_agent_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any error of the user's file, named
        raise ValueError(f"{where}: cannot load it ({type(e).__name__}: {e})") from None
    # OpenRLHF's classes told by name, not imported: openrlhf.utils takes seconds to import, and the file imported
    # them already if it uses them
    executor = getattr(module, "AgentExecutor", None)
    if isinstance(executor, type) and _defined_by(executor, "execute") != "MultiTurnAgentExecutor":
        raise ValueError(
            f"{where}: its AgentExecutor has an execute of its own, a loop over OpenRLHF's engine that cannot run "
            "on these engines; derive it from MultiTurnAgentExecutor without overriding execute"
        )
    agent = getattr(module, "AgentInstance", None)
    if not (isinstance(agent, type) and "AgentInstanceBase" in [c.__name__ for c in agent.__mro__]):
        raise ValueError(f"{where}: it defines no AgentInstance class derived from OpenRLHF's AgentInstanceBase")
    return agent


def _defined_by(cls: type, name: str) -> str:
    """The name of the class in `cls`'s MRO that defines attribute `name` ("" if none)."""
    return next((c.__name__ for c in cls.__mro__ if name in vars(c)), "")


@dataclass
class AgentSession:
    """What an agent episode needs beyond the engines (in `GroupRequest.tools`)."""

    agent: type  # the file's AgentInstance
    tokenizer: Any
    max_turns: int = 4
    max_total_tokens: int = 0  # 0: the request's max_new_tokens
    max_model_len: int = 0

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any) -> AgentSession:
        """`cfg`: the run's Config (not imported: the config imports this package)."""
        t = cfg.tools
        agent = load_agent(cfg.rollout.agent_file)
        return cls(agent, tokenizer, t.max_turns, t.max_total_tokens, cfg.rollout.max_model_len)


@register_group_rollout("openrlhf_agent")
async def openrlhf_agent_group(engines: TokenEngines, prompt: PromptItem, request: GroupRequest) -> list[Sample]:
    """The group's n episodes, all at once (module docstring)."""
    session = request.tools
    if not isinstance(session, AgentSession):
        raise ValueError(
            "--rollout.function openrlhf_agent: the group request carries no AgentSession (GroupRequest.tools); the "
            "streaming producer gives one to runs of this function"
        )
    return list(await asyncio.gather(*(_episode(engines, session, prompt, request, j) for j in range(request.n))))


async def _call(what: str, awaitable: Any) -> Any:
    try:
        return await asyncio.wait_for(awaitable, timeout=STEP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise TimeoutError(f"--rollout.agent_file: the agent's {what} took over {STEP_TIMEOUT_S:g} s") from None


def _number(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


async def _episode(
    engines: TokenEngines, session: AgentSession, prompt: PromptItem, request: GroupRequest, j: int
) -> Sample:
    tok = session.tokenizer
    agent = session.agent()
    observation = (await _call("reset", agent.reset({"observation": prompt.prompt, "label": prompt.label})))[
        "observation"
    ]
    if observation == prompt.prompt:
        prompt_ids = list(request.prompt_token_ids)
    else:
        prompt_ids = tok(observation, add_special_tokens=False)["input_ids"]
    budget = session.max_total_tokens or request.max_new_tokens
    seed = None if request.seed is None else request.seed + j
    ids: list[int] = []
    mask: list[int] = []
    log_probs: list[float] = []
    versions: list[int] = []
    turns: list[int] = []
    reward, score, extra, action, finish, stale = 0.0, None, {}, "", "length", 0
    for part in range(session.max_turns + 1):
        room = min(request.max_new_tokens, budget - len(ids))  # per generation, and what the episode has left
        if session.max_model_len:
            room = min(room, session.max_model_len - len(prompt_ids) - len(ids))
        if room <= 0:
            finish = "length"
            break
        part_seed = None if seed is None else (seed if part == 0 else (seed * 1_000_033 + part * 7_919) % 2**62)
        r = await engines.generate(
            TokenRequest(
                f"{request.tag}-{j}-{part}", prompt_ids + ids, room, request.temperature, request.top_p, part_seed
            )  # fmt: skip
        )
        action, finish = r.text, r.finish_reason
        ids += r.token_ids
        mask += [1] * len(r.token_ids)
        log_probs += r.log_probs
        versions += r.versions
        turns += [part + 1] * len(r.token_ids)
        stale += r.stale_kv_tokens
        params = types.SimpleNamespace(temperature=request.temperature, top_p=request.top_p, max_tokens=room)
        states = {"observation_text": observation, "action_text": action, "label": prompt.label,
                  "sampling_params": params}  # fmt: skip
        result = await _call("step", agent.step(states))
        reward += _number(result["rewards"])
        score = _number(result["scores"]) if result.get("scores") is not None else None
        extra = {k: _number(v) for k, v in (result.get("extra_logs") or {}).items()}
        feedback = result.get("environment_feedback") or ""
        observation += action + feedback
        fed = tok(feedback, add_special_tokens=False)["input_ids"] if feedback else []
        if len(ids) + len(fed) > budget:  # the feedback does not fit: the episode ends, cut
            finish = "length"
            break
        # appended after the last step too, as OpenRLHF does: masked, it changes nothing the policy is trained on
        ids += fed
        mask += [0] * len(fed)
        log_probs += [0.0] * len(fed)
        versions += [versions[-1] if versions else 0] * len(fed)
        turns += [0] * len(fed)
        if result["done"]:
            break
    metadata = {**prompt.metadata, "agent_reward": reward, "agent_score": reward if score is None else score}
    metadata["agent_logs"] = extra
    return Sample(
        prompt_index=prompt.index,
        prompt=prompt.prompt,
        prompt_token_ids=prompt_ids,
        response=action,
        response_token_ids=ids,
        rollout_log_probs=log_probs,
        label=prompt.label,
        policy_version=min((v for v, m in zip(versions, mask) if m), default=0),
        finish_reason=finish,
        data_source=prompt.data_source,
        metadata=metadata,
        messages=prompt.messages,
        response_mask=mask if ids else [],
        token_versions=versions,
        stale_kv_tokens=stale,
        token_turns=turns,
    )
