"""Rollout functions: how the trainer turns prompts into groups of responses (`--rollout.function`).

In `--rollout.mode batch` the trainer asks the function named by `--rollout.function` for one group of samples per
prompt of a batch; in `stream` and `partial` mode it runs that name's per-group coroutine for each prompt, many at
once, over the streaming engines (engines.py). The default, `single_turn`, is one generation per response, in both
forms; `python_tool` (python_tool.py) is a multi-turn episode that runs the policy's Python in the sandbox, and
`openrlhf_agent` (openrlhf_agent.py) runs an OpenRLHF agent file's episodes; both are streamed only. A new way of
rolling out is a function registered here or named by its import path, with nothing else in the trainer to change:

    from entropy_openrlhf.rollouts import GroupRequest, register_group_rollout

    @register_group_rollout("my_loop")
    async def my_loop(engines, prompt: PromptItem, request: GroupRequest) -> list[Sample]:
        ...  # await engines.generate(TokenRequest(...)) as often as needed; tokens the policy did not choose
        ...  # get response_mask 0
"""

from typing import Any

from entropy_openrlhf.rollouts.base import (
    GROUP_ROLLOUTS,
    ROLLOUTS,
    Engines,
    GroupRequest,
    GroupRolloutFn,
    RolloutFn,
    RolloutRequest,
    ThroughRolloutFunction,
    TokenEngines,
    check_groups,
    get_group_rollout,
    get_rollout,
    has_batch_form,
    register_group_rollout,
    register_rollout,
)
from entropy_openrlhf.rollouts.openrlhf_agent import AgentSession, load_agent, openrlhf_agent_group
from entropy_openrlhf.rollouts.python_tool import ToolSession, python_tool_group
from entropy_openrlhf.rollouts.single_turn import single_turn, single_turn_group


def group_session(cfg: Any, pool: Any, tokenizer: Any) -> ToolSession | AgentSession | None:
    """What every `GroupRequest.tools` of a run carries (`cfg`: its Config): python_tool's ToolSession (the sandbox
    pool `pool`, the tokenizer, --tools.*), openrlhf_agent's AgentSession (the agent file's class), else None."""
    if cfg.rollout.function == "python_tool":
        return ToolSession.from_config(cfg, pool, tokenizer)
    if cfg.rollout.function == "openrlhf_agent":
        return AgentSession.from_config(cfg, tokenizer)
    return None


__all__ = [
    "AgentSession",
    "GROUP_ROLLOUTS",
    "ROLLOUTS",
    "Engines",
    "GroupRequest",
    "GroupRolloutFn",
    "RolloutFn",
    "RolloutRequest",
    "ThroughRolloutFunction",
    "TokenEngines",
    "ToolSession",
    "check_groups",
    "get_group_rollout",
    "get_rollout",
    "group_session",
    "has_batch_form",
    "load_agent",
    "openrlhf_agent_group",
    "python_tool_group",
    "register_group_rollout",
    "register_rollout",
    "single_turn",
    "single_turn_group",
]
