"""Rollout functions: how the trainer turns a batch of prompts into groups of responses (`--rollout.function`).

The trainer asks the function named by `--rollout.function` for one group of samples per prompt; the default,
`single_turn`, is one generation per response. A new way of rolling out (multi-turn with tools, partial rollouts)
is a function registered here or named by its import path, with nothing else in the trainer to change:

    from entropy_openrlhf.rollouts import RolloutRequest, register_rollout

    @register_rollout("my_loop")
    def my_loop(engines, request: RolloutRequest) -> list[list[Sample]]:
        ...  # engines.generate(...) as often as needed; mark tokens the policy did not choose with response_mask 0
"""

from entropy_openrlhf.rollouts.base import (
    ROLLOUTS,
    Engines,
    RolloutFn,
    RolloutRequest,
    check_groups,
    get_rollout,
    register_rollout,
)
from entropy_openrlhf.rollouts.single_turn import single_turn

__all__ = [
    "ROLLOUTS",
    "Engines",
    "RolloutFn",
    "RolloutRequest",
    "check_groups",
    "get_rollout",
    "register_rollout",
    "single_turn",
]
