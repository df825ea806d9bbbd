"""The default rollout: one generation per response, `n` per prompt (`--rollout.function single_turn`)."""

from __future__ import annotations

import asyncio

from entropy_openrlhf.actors.engine_stream import TokenRequest
from entropy_openrlhf.rollouts.base import (
    Engines,
    GroupRequest,
    RolloutRequest,
    TokenEngines,
    register_group_rollout,
    register_rollout,
)
from entropy_openrlhf.samples import PromptItem, Sample


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


@register_group_rollout("single_turn")
async def single_turn_group(engines: TokenEngines, prompt: PromptItem, request: GroupRequest) -> list[Sample]:
    """The same, streamed: the group's n requests go out at once and come back as each finishes; each response
    token keeps the version that sampled it."""
    requests = [
        TokenRequest(
            f"{request.tag}-{j}",
            request.prompt_token_ids,
            request.max_new_tokens,
            request.temperature,
            request.top_p,
            None if request.seed is None else request.seed + j,
        )  # fmt: skip
        for j in range(request.n)
    ]
    results = await asyncio.gather(*(engines.generate(r) for r in requests))
    return [
        Sample(
            prompt_index=prompt.index,
            prompt=prompt.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            response=r.text,
            response_token_ids=r.token_ids,
            rollout_log_probs=r.log_probs,
            label=prompt.label,
            policy_version=min(r.versions, default=0),  # the oldest token's: what --async.max_staleness bounds
            finish_reason=r.finish_reason,
            data_source=prompt.data_source,
            metadata=dict(prompt.metadata),
            messages=prompt.messages,
            token_versions=r.versions,
            stale_kv_tokens=r.stale_kv_tokens,
        )
        for r in results
    ]
