"""The built-in math verifier as an OpenRLHF reward file: what OpenRLHF's `--reward.remote_url` (or here
`--reward.verifier rewards/examples/openrlhf_math.py`) loads, `reward_func(queries, prompts, labels)`.

OpenRLHF passes each whole decoded sequence as the query, prompt first, special tokens kept, so the response is what
follows the prompt, ending with the end-of-turn token where it stopped there (`<|im_end|>`); the math verifier reads
its answer either way. Each sample is scored by `rewards.math.math_verifier` (docs/guides/verifiers.md).
"""

from __future__ import annotations

import torch

from rewards.math import math_verifier


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs) -> dict:
    results = [
        math_verifier(query[len(prompt) :] if query.startswith(prompt) else query, label)
        for query, prompt, label in zip(queries, prompts, labels, strict=True)
    ]
    rewards = torch.tensor([r["reward"] for r in results])
    # scores >= 1 is what OpenRLHF (and this trainer) count as correct; format_ok shows up as reward/format_ok
    format_ok = torch.tensor([float(r["format_ok"]) for r in results])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"format_ok": format_ok}}
