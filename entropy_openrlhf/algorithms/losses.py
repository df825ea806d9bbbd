"""Policy losses: PPO (with clip-higher and dual-clip), Clip-Cov, KL-Cov, high_entropy (80/20), CISPO, GSPO, SAPO,
DPPO and CE-GPPO.

Plain functions over (B, L) tensors, as docs/algorithms/losses.md states them (Clip-Cov and KL-Cov: arXiv 2505.22617;
high_entropy: arXiv 2506.01939; CISPO: arXiv 2506.13585; GSPO: arXiv 2507.18071; SAPO, DPPO and CE-GPPO: that page,
with the upstream code they follow). Each returns a `LossOutput` with
the scalar loss, the per-token loss matrix, the mask of the tokens the method selected and a metrics dict of floats.

This module is the one place to import them from. Each loss lives with its objective in algorithms/objectives/
(`clip_cov_loss` and `clip_cov_select` in objectives/clip_cov.py, ...), and what several share (aggregation, the
covariance, PPO's ratio terms, the entropy bonus) in algorithms/loss_terms.py, whose docstring states the
conventions every loss keeps. Two of them are the losses' own:
- covariance-selected tokens stay in the denominator (Clip-Cov zeroes their numerator, KL-Cov adds beta*|d|);
  high_entropy is the exception: its mean runs over the entropy-selected tokens only;
- an objective file must not import this module (it imports them): they take what they share from loss_terms.
"""

from __future__ import annotations

from entropy_openrlhf.algorithms.loss_terms import (
    LOG_RATIO_CLAMP,
    AggMode,
    LossOutput,
    aggregate,
    check_ratio,
    entropy_bonus,
    token_covariance,
)
from entropy_openrlhf.algorithms.objectives.ce_gppo import ce_gppo_loss
from entropy_openrlhf.algorithms.objectives.cispo import cispo_loss
from entropy_openrlhf.algorithms.objectives.clip_cov import clip_cov_loss, clip_cov_select
from entropy_openrlhf.algorithms.objectives.dppo import dppo_loss
from entropy_openrlhf.algorithms.objectives.gspo import gspo_loss
from entropy_openrlhf.algorithms.objectives.high_entropy import high_entropy_loss, high_entropy_select
from entropy_openrlhf.algorithms.objectives.kl_cov import kl_cov_loss, kl_cov_select
from entropy_openrlhf.algorithms.objectives.ppo import ppo_loss
from entropy_openrlhf.algorithms.objectives.sapo import sapo_loss

__all__ = [
    "LOG_RATIO_CLAMP",
    "AggMode",
    "LossOutput",
    "aggregate",
    "ce_gppo_loss",
    "check_ratio",
    "cispo_loss",
    "clip_cov_loss",
    "clip_cov_select",
    "dppo_loss",
    "entropy_bonus",
    "gspo_loss",
    "high_entropy_loss",
    "high_entropy_select",
    "kl_cov_loss",
    "kl_cov_select",
    "ppo_loss",
    "sapo_loss",
    "token_covariance",
]
