"""What the trainer decides from a step's numbers alone: the note a starved covariance selection gets, and which
weights are evaluated in training. Pure functions of the config and the metrics, tested without a run.
"""

from __future__ import annotations

from entropy_openrlhf.algorithms.objectives import get_objective
from entropy_openrlhf.config import Config

STARVED_STEPS = 3  # consecutive steps in which a covariance selection sits at its floor before the run says so


def starvation_note(cfg: Config, metrics: dict[str, float]) -> str | None:
    """What the run prints once when, for STARVED_STEPS steps in a row, every micro-batch of the objective selected
    nothing or only its one-token floor (`metrics`: the last such step's). Steps without any signal are named as
    such, whatever the objective; otherwise the objective says what is true of its own floor (its `run_note`)."""
    if metrics.get("cov/max", 0.0) == 0.0 and metrics.get("cov/p99", 0.0) == 0.0:
        # every advantage was 0: each group's samples scored alike (all wrong, say), which no objective setting
        # changes, so no objective's advice would help these steps
        return (
            f"[entropy-openrlhf] {cfg.loss.type} selected nothing for {STARVED_STEPS} steps: every token's "
            "covariance was 0 in the last of them: all advantages were 0, each group's samples scoring alike, so "
            "there was nothing to select and no gradient for any objective. Easier prompts or more samples per "
            "prompt (--rollout.n_samples_per_prompt) give groups that differ."
        )
    return get_objective(cfg.loss.type).run_note(getattr(cfg.loss, cfg.loss.type), metrics)


def eval_due(version: int, every: int, initial: bool) -> bool:
    """Whether weights of `version` are evaluated in training (the final weights always are): every `every`
    versions, version 0 only with `initial` (the base model is often evaluated once, apart from the runs)."""
    return every > 0 and version % every == 0 and (version > 0 or initial)
