"""What the policy is trained on: the `--loss.*` flags (the objective, its shared settings, and each registered
objective's own as `--loss.<name>.*`), the `--entropy.*` flags (the entropy controller) and the `--algo.*` flags
(advantage estimator, KL to the reference, dynamic sampling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from entropy_openrlhf.algorithms import entropy_control
from entropy_openrlhf.algorithms.advantages import ESTIMATORS
from entropy_openrlhf.algorithms.entropy_control import EntropyControlConfig
from entropy_openrlhf.algorithms.loss_terms import AGG_MODES
from entropy_openrlhf.algorithms.objectives import OBJECTIVES
from entropy_openrlhf.config.base import Section, _failed
from entropy_openrlhf.options import option as _f  # short: every field below uses it


@dataclass
class LossOptions(Section):
    """The settings every objective shares; each objective adds its own as --loss.<name>.<field>."""

    type: str = _f("kl_cov", "the policy objective: {choices} (docs/algorithms/losses.md)", choices=tuple(OBJECTIVES))
    clip_low: float = _f(
        0.2, "PPO clip epsilon below 1 for the objectives with PPO's clip: ppo, clip_cov, high_entropy, ce_gppo"
    )
    clip_high: float = _f(0.2, "PPO clip epsilon above 1 (clip-higher: 0.28)")
    dual_clip: float = _f(0.0, "dual-clip constant c > 1 for ppo and ce_gppo (0 = off)")
    agg: str = _f(
        "token_mean",
        "{choices}, normalised over the whole optimizer step (docs/algorithms/losses.md: verl's loss_agg_mode, TRL's "
        "loss_type)",
        choices=AGG_MODES,
    )
    agg_norm_len: int = _f(0, "seq_mean_token_sum_norm's constant length (Dr.GRPO); 0 = --rollout.max_new_tokens")
    mask_truncated: bool = _f(
        False, "responses cut at --rollout.max_new_tokens leave the loss and its normaliser (TRL's "
        "mask_truncated_completions)",
    )  # fmt: skip
    scope: str = _f(
        "micro_batch",
        "token selection (clip_cov, kl_cov, high_entropy) over: micro_batch (reference code) | global (the mini-batch, "
        "all ranks)",
        choices=("micro_batch", "global"),
    )
    entropy_coef: float = _f(
        0.0,
        "entropy bonus alpha: adds -alpha * H (token entropy of the current policy, aggregated like the policy loss) "
        "to any objective's loss; 0 = off, nothing computed. With --entropy.target it is the bonus's base, which the "
        "controller raises up to --entropy.max_bonus below the band",
    )

    def checks(self) -> list[str]:
        """The shared settings; each objective's own are checked by `validate()` (its notes read other sections)."""
        if self.type == "clip_higher":
            why = "clip_higher is ppo with a wider upper clip: --loss.type ppo --loss.clip_high 0.28 " \
                  "(pipelines/clip_higher.py sets both)"  # fmt: skip
        else:
            why = f"{self.type!r} is not one of {', '.join(OBJECTIVES)}"
        return _failed(
            (self.type in OBJECTIVES, "loss.type", why),
            (self.clip_low >= 0 and self.clip_high >= 0, "loss.clip_low", "clip epsilons must be >= 0"),
            (self.dual_clip == 0 or self.dual_clip > 1, "loss.dual_clip", "must be 0 (off) or > 1"),
            (self.agg_norm_len >= 0, "loss.agg_norm_len", "must be >= 0 (0 = --rollout.max_new_tokens)"),
            (
                0 <= self.entropy_coef < float("inf"),  # NaN fails the comparison too
                "loss.entropy_coef",
                f"{self.entropy_coef} must be a finite number >= 0 (0 = no entropy bonus)",
            ),
        )


# One field per registered objective, holding its config: `cfg.loss.kl_cov.ratio` is `--loss.kl_cov.ratio`.
LossConfig = dataclasses.make_dataclass(
    "LossConfig",
    [(name, obj.config, field(default_factory=obj.config)) for name, obj in OBJECTIVES.items()],
    bases=(LossOptions,),
)


@dataclass
class EntropyConfig(EntropyControlConfig, Section):
    knob: str = _f(
        "",
        "the objective's setting the controller scales; empty = its first: kl_cov coef | ratio, clip_cov ratio, "
        "high_entropy top_frac (divided by the scale)",
    )

    def checks(self) -> list[str]:
        return entropy_control.validate(self)


@dataclass
class AlgoConfig(Section):
    advantage: str = _f("grpo", "advantage estimator: {choices}", choices=tuple(ESTIMATORS))
    kl_coef: float = _f(0.0, "KL-to-reference loss coefficient (paper: 0; the metric is logged either way)")
    kl_estimator: str = _f("k3", "estimator of the reference KL: {choices}", choices=("k1", "k2", "k3"))
    dynamic_sampling: bool = _f(False, "DAPO filter: drop prompt groups whose rewards are all equal and refill")
    max_gen_batches: int = _f(3, "dynamic sampling: generation rounds per step before training on what was kept")
    entropy_adv_alpha: float = _f(
        0.0,
        "entropy-based advantage (Cheng et al.), any objective: A + min(alpha * H, |A| / kappa) per token, H the "
        "current policy's token entropy, in every loss call; 0 = off (their GRPO runs: 0.4, PPO runs: 0.1)",
    )
    entropy_adv_kappa: float = _f(
        2.0, "the entropy-based advantage's cap: the bonus is at most |A| / kappa, so no advantage changes sign (>= 1)"
    )

    def checks(self) -> list[str]:
        return _failed(
            (self.kl_coef >= 0, "algo.kl_coef", "must be >= 0"),
            (self.max_gen_batches >= 1, "algo.max_gen_batches", f"{self.max_gen_batches} must be >= 1"),
            (
                0 <= self.entropy_adv_alpha < float("inf"),  # NaN fails the comparison too
                "algo.entropy_adv_alpha",
                f"{self.entropy_adv_alpha} must be a finite number >= 0 (0 = off)",
            ),
            (
                1 <= self.entropy_adv_kappa < float("inf"),
                "algo.entropy_adv_kappa",
                f"{self.entropy_adv_kappa} must be a finite number >= 1: below 1 the bonus could turn a negative "
                "advantage positive",
            ),
        )

    def entropy_adv(self) -> tuple[float, float] | None:
        """The loss calls' `LossContext.entropy_adv`: (alpha, kappa), or None when the shaping is off."""
        return (self.entropy_adv_alpha, self.entropy_adv_kappa) if self.entropy_adv_alpha > 0 else None
