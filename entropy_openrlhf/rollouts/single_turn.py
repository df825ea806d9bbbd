"""The default rollout: one generation per response, `n` per prompt (`--rollout.function single_turn`)."""

from __future__ import annotations

from entropy_openrlhf.rollouts.base import Engines, RolloutRequest, register_rollout
from entropy_openrlhf.samples import Sample


@register_rollout("single_turn")
def single_turn(engines: Engines, request: RolloutRequest) -> list[list[Sample]]:
    """Every response is one completion of its prompt; every response token is the policy's (mask all 1)."""
    samples = engines.generate(
        request.prompts,
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        max_new_tokens=request.max_new_tokens,
        seed=request.seed,
        policy_version=request.policy_version,
    )
    return [samples[i : i + request.n] for i in range(0, len(samples), request.n)]
