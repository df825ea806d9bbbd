"""What a rollout function is, the registry that holds them by name, and the check of what one returns.

A rollout function takes the engines and a `RolloutRequest` and returns one list of `n` samples per prompt, in the
prompts' order. Each sample carries its token ids, the behaviour log-prob of each response token
(`rollout_log_probs`), a `response_mask` (1 on the tokens the policy chose, 0 on tokens it only read, such as a
tool's output) and the prompt's chat `messages`. Rewards, the reference and the advantages come after it, in the
trainer, the same for every function.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from entropy_openrlhf.actors.engine_stream import TokenRequest, TokenResult
from entropy_openrlhf.samples import PromptItem, Sample


class Engines(Protocol):
    """The part of the rollout group a rollout function uses (actors/rollout.py::RolloutGroup)."""

    def generate(
        self,
        prompts: list[PromptItem],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None,
        policy_version: int,
    ) -> list[Sample]: ...


@dataclass(frozen=True)
class RolloutRequest:
    """One batch to roll out: the prompts, the samples per prompt and how to sample them."""

    prompts: list[PromptItem]
    n: int  # responses per prompt: the group size
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int | None  # derived from the run's seed and the prompt stream's position, so a resumed step repeats it
    policy_version: int  # the version of the weights the engines hold


RolloutFn = Callable[[Engines, RolloutRequest], list[list[Sample]]]

ROLLOUTS: dict[str, RolloutFn] = {}


class TokenEngines(Protocol):
    """What a group rollout coroutine uses of the streaming engines (rollouts/engines.py::StreamEngines)."""

    async def generate(self, request: TokenRequest) -> TokenResult: ...


@dataclass(frozen=True)
class GroupRequest:
    """How to roll out one prompt's group in `--rollout.mode stream|partial`."""

    prompt_token_ids: list[int]  # the prompt as the policy reads it: tokenised once, never again
    n: int  # responses: the group size
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int | None  # the group's: its j-th response is seeded seed + j (what vLLM gives an n-sample request)
    tag: str  # unique among the requests in flight (a request id is f"{tag}-{j}", or begins so)
    # what a multi-turn rollout needs beyond the engines: python_tool's ToolSession (the sandbox pool, the tokenizer,
    # --tools.*), which the trainer gives runs whose rollout function uses tools; None otherwise
    tools: Any = None


# A group rollout: one prompt's n samples, as a coroutine over the streaming engines. Many run at once.
GroupRolloutFn = Callable[[TokenEngines, PromptItem, GroupRequest], Awaitable[list[Sample]]]

GROUP_ROLLOUTS: dict[str, GroupRolloutFn] = {}


def register_group_rollout(name: str) -> Callable[[GroupRolloutFn], GroupRolloutFn]:
    """Decorator: registers a group rollout coroutine under `name` (`--rollout.function` in stream and partial
    mode)."""

    def wrap(fn: GroupRolloutFn) -> GroupRolloutFn:
        if name in GROUP_ROLLOUTS:
            raise ValueError(f"group rollout {name!r} is registered twice")
        GROUP_ROLLOUTS[name] = fn
        return fn

    return wrap


def get_group_rollout(name: str) -> GroupRolloutFn:
    """The group rollout coroutine `--rollout.function` names in stream and partial mode. Raises ValueError naming
    the flags and what is registered."""
    if name not in GROUP_ROLLOUTS:
        raise ValueError(
            f"--rollout.function {name!r} has no per-group coroutine, which --rollout.mode stream and partial need: "
            f"those are {', '.join(GROUP_ROLLOUTS)} (or --rollout.mode batch)"
        )
    return GROUP_ROLLOUTS[name]


def has_batch_form(name: str) -> bool:
    """Whether `--rollout.function name` has a batch rollout function (`--rollout.mode batch`, and evaluation outside
    the streaming producer): a registered one or an import path. A name with only a group coroutine
    (python_tool) runs streamed only."""
    return name in ROLLOUTS or ":" in name


def register_rollout(name: str) -> Callable[[RolloutFn], RolloutFn]:
    """Decorator: registers a rollout function under `name` (the value of `--rollout.function`)."""

    def wrap(fn: RolloutFn) -> RolloutFn:
        if name in ROLLOUTS:
            raise ValueError(f"rollout function {name!r} is registered twice")
        ROLLOUTS[name] = fn
        return fn

    return wrap


def get_rollout(name: str) -> RolloutFn:
    """The rollout function `name`: a registered name, or `package.module:function` imported on the spot (a user's
    own, which registers nothing). Raises ValueError naming the flag and what is known."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--rollout.function {name}: cannot load it ({e})") from None
        if not callable(fn):
            raise ValueError(f"--rollout.function {name}: {attr} is not a function")
        return fn
    if name not in ROLLOUTS and name in GROUP_ROLLOUTS:
        raise ValueError(
            f"--rollout.function {name!r}: {name} runs in --rollout.mode stream or partial only (its episodes need "
            "the token-in/token-out streaming engines); give --rollout.mode stream"
        )
    if name not in ROLLOUTS:
        close = difflib.get_close_matches(name, list(ROLLOUTS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(
            f"--rollout.function {name!r}: registered are {', '.join(ROLLOUTS)}, or give package.module:function{hint}"
        )
    return ROLLOUTS[name]


class ThroughRolloutFunction:
    """The engines' `generate`, answered by a rollout function: what evaluation calls, so that held-out prompts are
    rolled out by `--rollout.function` as the training prompts are."""

    def __init__(self, fn: RolloutFn, engines: Engines, name: str):
        self.fn, self.engines, self.name = fn, engines, name

    def generate(
        self,
        prompts: list[PromptItem],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None,
        policy_version: int,
    ) -> list[Sample]:
        request = RolloutRequest(prompts, n, temperature, top_p, max_new_tokens, seed, policy_version)
        groups = self.fn(self.engines, request)
        check_groups(groups, request, self.name)
        return [s for g in groups for s in g]


def check_groups(groups: list[list[Sample]], request: RolloutRequest, name: str) -> None:
    """Raise ValueError naming the rollout function, the prompt and the field unless `groups` holds `request.n`
    well-formed samples for each prompt, in order: the trainer's advantages and the policy's loss read them so."""
    if len(groups) != len(request.prompts):
        raise ValueError(f"rollout function {name}: {len(groups)} groups for {len(request.prompts)} prompts")
    for prompt, group in zip(request.prompts, groups):
        if len(group) != request.n:
            raise ValueError(
                f"rollout function {name}: prompt {prompt.index} got {len(group)} samples, not {request.n}"
            )
        for j, sample in enumerate(group):
            where = f"rollout function {name}: prompt {prompt.index}, sample {j}"
            if sample.prompt_index != prompt.index:
                raise ValueError(f"{where}: prompt_index is {sample.prompt_index}")
            sample.check(where)
