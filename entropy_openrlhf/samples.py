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
    # the chat messages `prompt` was templated from (None for a plain-text prompt): what a multi-turn rollout
    # function extends with its own turns before templating again
    messages: list[dict[str, Any]] | None = None


@dataclass
class Sample:
    """One response to one prompt, from generation through reward."""

    prompt_index: int  # PromptItem.index; responses sharing it form a GRPO group
    prompt: str
    prompt_token_ids: list[int]
    response: str
    response_token_ids: list[int]
    # the behaviour policy's log-prob of each response token, as the engine sampled it (the off-policy correction's
    # pi_rollout)
    rollout_log_probs: list[float]
    label: str
    policy_version: int  # version of the weights that generated it
    finish_reason: str = ""  # "stop" (eos) or "length" (truncated)
    data_source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None  # the prompt's chat messages (PromptItem.messages)
    # 1 for each response token the policy is trained on, 0 for tokens it did not choose (a tool's output inside a
    # multi-turn response); empty = every token, filled in on construction
    response_mask: list[int] = field(default_factory=list)
    ref_log_probs: list[float] | None = None  # the reference model's log-prob of each response token, when it runs
    # streamed (--rollout.mode stream|partial): the policy version that sampled each response token (a partial
    # rollout's span two or more; `policy_version` is then the oldest), and how many were sampled while part of
    # their context's KV came from older weights (rollout/stale_kv_token_frac)
    token_versions: list[int] | None = None
    stale_kv_tokens: int = 0
    # multi-turn rollouts (tool episodes): the policy's turn each response token belongs to (1, 2, ...), 0 on the
    # tokens it did not choose; what the per-turn entropy metrics group by. None: one turn
    token_turns: list[int] | None = None
    # filled by the reward group
    reward: float = 0.0
    acc: bool = False
    format_ok: bool = False
    reward_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.response_mask:
            self.response_mask = [1] * len(self.response_token_ids)

    def check(self, where: str) -> None:
        """Raise ValueError, naming `where` and the field, unless the per-token fields line up with the response."""
        n = len(self.response_token_ids)
        for name in ("rollout_log_probs", "response_mask", "ref_log_probs", "token_versions", "token_turns"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{where}: {name} has {len(values)} values for {n} response tokens")
        if any(m not in (0, 1) for m in self.response_mask):
            raise ValueError(f"{where}: response_mask holds values other than 0 and 1")
