"""Off-policy correction between the policy that sampled a response and the trainer's pi_old.

The engine's log-probs (`rollout`) and the trainer's (`old`) differ for two reasons: an async run trains on
responses sampled by weights up to `async.max_staleness` versions behind, and vLLM's kernels and precision do not
reproduce the trainer's numbers, a gap that accumulates over long responses. This module turns the two into a
per-token factor on the loss: a truncated importance weight pi_old / pi_rollout (token or sequence level) and a
rejection band that drops tokens or whole responses whose ratio is out of reach of any weight.
docs/algorithms/off_policy.md
states the definitions, the presets and how they compare with verl, TRL and SkyRL.

Plain functions over (B, L) tensors: fp32 math whatever the input dtype, inputs zeroed outside the mask first (NaN
or Inf on padding never reaches a weight or a metric), outputs detached (a weight rescales the loss; it is not
differentiated), empty responses give weight 0 and no NaN.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from entropy_openrlhf.algorithms.loss_terms import LOG_RATIO_CLAMP

IS_LEVELS = ("none", "token", "sequence")
REJECT_MODES = ("none", "token", "sequence_geo", "sequence")
STALENESS_KEYS = ("kl_k1", "kl_k3", "rejected_frac", "ess")


@dataclass(frozen=True)
class OffPolicyConfig:
    """`--offpolicy.*`. Frozen so that a shared preset cannot be changed by one of its users."""

    is_level: str = "none"  # none | token | sequence: where the importance weight is computed
    is_min: float = 0.0  # lower truncation of the weight; 0 = none (a ratio is never negative)
    is_max: float = 2.0  # upper truncation of the weight (TIS cap)
    reject: str = "none"  # none | token | sequence_geo | sequence: what a ratio out of the band drops
    reject_min: float = 0.5
    reject_max: float = 2.0
    bypass: bool = False  # the rollout's log-probs are pi_old: no old-log-prob forward, nothing to correct

    @property
    def weighs(self) -> bool:
        """Whether a token may weigh other than 1: an importance weight or a rejection is asked for."""
        return self.is_level != "none" or self.reject != "none"

    def __post_init__(self) -> None:
        for name, allowed in (("is_level", IS_LEVELS), ("reject", REJECT_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"offpolicy.{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("is_min", "is_max", "reject_min", "reject_max"):
            if not getattr(self, name) >= 0:  # `not >=` also refuses NaN
                raise ValueError(f"offpolicy.{name}: {getattr(self, name)} must be >= 0")
        # min > max first, so that it is the message a reversed band gets
        for low, high in (("is_min", "is_max"), ("reject_min", "reject_max")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"offpolicy.{low}: {getattr(self, low)} is above offpolicy.{high} {getattr(self, high)}"
                )
        # a band that excludes ratio 1 would rescale or drop on-policy tokens, which need no correction
        for name in ("is_max", "reject_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"offpolicy.{name}: {getattr(self, name)} must be >= 1 (ratio 1 is on-policy)")
        for name in ("is_min", "reject_min"):
            if getattr(self, name) > 1:
                raise ValueError(f"offpolicy.{name}: {getattr(self, name)} must be <= 1 (ratio 1 is on-policy)")
        if self.bypass:
            for name in ("is_level", "reject"):
                if getattr(self, name) != "none":
                    raise ValueError(
                        f"offpolicy.bypass: with bypass pi_old is the rollout policy, there is no gap to correct; "
                        f"offpolicy.{name} must be 'none', not {getattr(self, name)!r}"
                    )


PRESETS: dict[str, OffPolicyConfig] = {
    "none": OffPolicyConfig(),
    # TIS with verl's and SkyRL's token cap; an asynchronous run's default (default_for)
    "token_tis": OffPolicyConfig(is_level="token", is_max=2.0),
    # verl's decoupled_seq_is cap (SkyRL defaults to 5, TRL's sequence_truncate to 3)
    "seq_tis": OffPolicyConfig(is_level="sequence", is_max=2.0),
    # IcePop: tokens out of [0.5, 5] dropped, the rest keep their untruncated ratio (verl, NeMo-RL, OpenRLHF)
    "token_mask": OffPolicyConfig(is_level="token", is_max=5.0, reject="token", reject_min=0.5, reject_max=5.0),
    # SkyRL's geometric mask band; verl's and NeMo-RL's (about +-0.1 %) leave too little room for one version's lag
    "geo_mask": OffPolicyConfig(reject="sequence_geo", reject_min=0.99, reject_max=1.01),
    "bypass": OffPolicyConfig(bypass=True),
}


def preset(name: str) -> OffPolicyConfig:
    if name not in PRESETS:
        raise ValueError(f"offpolicy.preset: {name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]


def default_for(is_async: bool) -> OffPolicyConfig:
    """What a run with no --offpolicy.* flag applies: token TIS capped at 2 when it is asynchronous (the rollout
    policy lags pi_old), nothing when it is synchronous (no lag to correct)."""
    return PRESETS["token_tis"] if is_async else PRESETS["none"]


@dataclass
class OffPolicyResult:
    weights: torch.Tensor  # (B, L) float32: the factor on each token's loss; 0 where rejected and on padding
    keep: torch.Tensor  # (B, L) bool: the valid tokens that stay in the loss
    metrics: dict[str, float]


def correct(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig
) -> OffPolicyResult:
    """Weights and kept tokens of one (B, L) batch, and its `offpolicy/*` metrics.

    With `cfg.bypass` the trainer uses the rollout's log-probs as pi_old, so `old_log_probs` is ignored: every
    valid token gets weight 1 and the gap metrics are 0.
    """
    if not old_log_probs.shape == rollout_log_probs.shape == mask.shape:
        raise ValueError(
            f"shape mismatch: old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)}, mask {tuple(mask.shape)}"
        )
    valid = mask.detach().bool()
    rollout = rollout_log_probs.detach().float()
    old = rollout if cfg.bypass else old_log_probs.detach().float()
    # torch.where, not multiplication: NaN * 0 is NaN
    log_ratio = torch.where(valid, (old - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    ratio = log_ratio.exp()
    seq_log = log_ratio.sum(-1, keepdim=True)
    # the mean over zero tokens is 0 (ratio 1); those rows are dropped by `valid` anyway
    seq_mean = seq_log / valid.sum(-1, keepdim=True).clamp(min=1)
    # a sum over a long response can leave exp's fp32 range: clamped as a token's is, so that is_max = inf stays finite
    seq_ratio = seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(ratio)

    raw = {"none": torch.ones_like(ratio), "token": ratio, "sequence": seq_ratio}[cfg.is_level]
    is_w = raw.clamp(cfg.is_min, cfg.is_max) if cfg.is_level != "none" else raw
    keep = valid
    if cfg.reject != "none":
        stat = {"token": ratio, "sequence_geo": seq_mean.exp().expand_as(ratio), "sequence": seq_ratio}[cfg.reject]
        keep = valid & (stat >= cfg.reject_min) & (stat <= cfg.reject_max)
    weights = torch.where(keep, is_w, 0.0)

    n = int(valid.sum())
    vd = valid.double()

    def share(x: torch.Tensor) -> float:  # mean over the valid tokens, in fp64; 0 when there are none
        return float((x.double() * vd).sum() / n) if n else 0.0

    w = weights.double()
    sum_w2 = float((w * w).sum())
    clipped = cfg.is_level != "none"
    metrics = {
        "offpolicy/kl_k1": share(-log_ratio),
        "offpolicy/kl_k3": share(ratio - 1 - log_ratio),
        "offpolicy/rejected_frac": share(valid & ~keep),
        # (sum w)^2 / (N sum w^2): 1 when all weights are equal, 1/N when a single token carries the batch
        "offpolicy/ess": float(w.sum()) ** 2 / (n * sum_w2) if n and sum_w2 > 0 else 0.0,
        "offpolicy/weight_mean": share(weights),
        "offpolicy/weight_max": float(weights[valid].max()) if n else 0.0,
        # truncation is read from the ratio before rejection, so the two diagnostics stay separate
        "offpolicy/clipped_high_frac": share(raw > cfg.is_max) if clipped else 0.0,
        "offpolicy/clipped_low_frac": share(raw < cfg.is_min) if clipped else 0.0,
    }
    return OffPolicyResult(weights=weights, keep=keep, metrics=metrics)


def metrics_by_staleness(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    staleness: torch.Tensor,
    cfg: OffPolicyConfig,
    also: Iterable[int] = (),
) -> dict[str, float]:
    """kl_k1, kl_k3, rejected_frac and ess of the tokens of each staleness value (policy versions between the
    sampling weights and the trainer's), as `offpolicy/staleness_<v>/<name>`. `staleness` is per response (B,) or,
    for streamed samples whose tokens carry their own versions, per token (B, L): then each value's metrics are those
    of its tokens alone (a sequence-level correction sees only those tokens of each response). The staleness-0 tokens
    carry the numeric mismatch alone, so their gap against the stale ones' tells how much of the correction async lag
    asks for. `token_frac` is each value's share of the batch's valid tokens, to weigh them; a value of `also` that
    no valid token here has gets a `token_frac` of 0 alone."""
    per_token = token_staleness(staleness, mask)
    total = int(mask.bool().sum())
    out: dict[str, float] = {}
    for v in staleness_values(per_token, mask):
        tokens = mask * (per_token == v).to(mask.dtype)
        metrics = correct(old_log_probs, rollout_log_probs, tokens, cfg).metrics
        for key in STALENESS_KEYS:
            out[f"offpolicy/staleness_{v}/{key}"] = metrics[f"offpolicy/{key}"]
        out[f"offpolicy/staleness_{v}/token_frac"] = int(tokens.bool().sum()) / total if total else 0.0
    for v in also:
        out.setdefault(f"offpolicy/staleness_{v}/token_frac", 0.0)
    return out


def token_staleness(staleness: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`staleness` per response (B,) or per token (B, L) as a (B, L) tensor on the mask's device."""
    staleness = staleness.to(mask.device)
    if staleness.shape == mask.shape[:1]:
        return staleness[:, None].expand(mask.shape)
    if staleness.shape != mask.shape:
        raise ValueError(f"shape mismatch: staleness {tuple(staleness.shape)}, mask {tuple(mask.shape)}")
    return staleness


def staleness_values(staleness: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The staleness values of the valid tokens, ascending (per response or per token, as token_staleness takes)."""
    return sorted({int(v) for v in token_staleness(staleness, mask)[mask.bool()].tolist()})


def selection_by_staleness(selected: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor) -> dict[str, float]:
    """Where a covariance selection (Clip-Cov's, KL-Cov's: `selected`, (B, L) bool) falls by token age: for each
    staleness value, its share of the selected tokens, `cov/staleness_<v>/selected_share`, to set beside the value's
    share of all tokens (`offpolicy/staleness_<v>/token_frac`): above it, the selection favours tokens of that age.
    {} when nothing was selected."""
    chosen = selected.bool() & mask.bool()
    count = int(chosen.sum())
    if not count:
        return {}
    per_token = token_staleness(staleness, mask)
    return {
        f"cov/staleness_{v}/selected_share": int((chosen & (per_token == v)).sum()) / count
        for v in staleness_values(per_token, mask)
    }
