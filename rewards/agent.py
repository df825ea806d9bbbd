"""`--reward.verifier agent`: the reward an OpenRLHF agent file gave its episode (`--rollout.function
openrlhf_agent`, entropy_openrlhf/rollouts/openrlhf_agent.py), which the rollout keeps in the sample's metadata."""

from __future__ import annotations

from typing import Any


def agent_reward(response: str, label: str, *, prompt: str = "", metadata: dict[str, Any] | None = None) -> dict:
    """The episode's summed `rewards` as the reward; `acc` when its last `scores` (OpenRLHF's 0-1 score for dynamic
    filtering; the reward when the agent gives none) reaches 1. Raises KeyError on a sample no agent rolled out."""
    metadata = metadata or {}
    if "agent_reward" not in metadata:
        raise KeyError("--reward.verifier agent scores --rollout.function openrlhf_agent's episodes only")
    score = float(metadata.get("agent_score", metadata["agent_reward"]))
    return {"reward": float(metadata["agent_reward"]), "acc": score >= 1.0, **metadata.get("agent_logs", {})}
