"""The records that flow between the actor groups in one RL step: prompts -> rollout (vLLM) -> reward -> reference
-> policy (the driver that moves them is entropy_openrlhf/pipeline/trainer.py).

Plain dataclasses of Python types, so Ray pickles them cheaply and any group can be tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptItem:
    """One row of the dataset, ready for generation."""

    index: int  # position in the dataset file; also the prompt group id of its responses
    prompt: str  # the text given to the engine (chat template already applied)
    label: str  # ground truth handed to the verifier
    data_source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One response to one prompt, from generation through reward."""

    prompt_index: int  # PromptItem.index; responses sharing it form a GRPO group
    prompt: str
    prompt_token_ids: list[int]
    response: str
    response_token_ids: list[int]
    rollout_log_probs: list[float]  # the engine's log-prob of each response token (importance-sampling correction)
    label: str
    policy_version: int  # version of the weights that generated it
    finish_reason: str = ""  # "stop" (eos) or "length" (truncated)
    data_source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # filled by the reward group
    reward: float = 0.0
    acc: bool = False
    format_ok: bool = False
    reward_info: dict[str, Any] = field(default_factory=dict)
