"""The class that stands in for OpenRLHF 0.11.2's `PolicyLoss`, the `training_step` wrapper that logs its metrics,
and the objective's settings they are built from (`build_settings`).

`entropy_openrlhf.integrations.openrlhf.install()` builds these and patches them into
`openrlhf.trainer.ray.ppo_actor`; this module only defines them (it imports torch, which the light entry module
must not, since Ray runs that one in every worker process).

What the adapter keeps from OpenRLHF, so that a run differs from OpenRLHF's own PPO only by the objective:
- its constructor arguments and its call, `(log_probs, old_log_probs, advantages, action_mask=,
  rollout_log_probs=, dp_size=, batch_num_tokens=, global_batch_size=)`, and its five return values;
- its train/rollout importance-sampling flags (`--algo.advantage.is_correction_*`), mapped onto this project's
  off-policy correction (`off_policy_from_openrlhf`, `algorithms.off_policy.correct`, the same code as our trainer's):
  the same per-token weight for the ratio gate, multiplied into the objective's per-token loss as OpenRLHF multiplies
  it into PPO's; the binary_kl and tv gates have no equivalent there and are refused;
- its loss normalisation: `token_level_loss` picks token-mean or sequence-mean, and the global normalisers that
  `ppo_train` hands every micro-batch (`batch_num_tokens`, already divided by the gradient-accumulation steps, and
  `dp_size`) become the objective's `LossContext.tokens` / `sequences` / `dp_size`, whose aggregation is
  `sum / normaliser * dp_size`, the formula of OpenRLHF's `aggregate_loss`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from entropy_openrlhf.algorithms.objectives import (
    OBJECTIVES,
    LossContext,
    objective_needs_entropy,
    run_objective,
    unknown_objective,
    within_chain,
)
from entropy_openrlhf.algorithms.off_policy import OffPolicyConfig, OffPolicyResult, correct

# The objective's metric names, as our own trainer logs them (docs/guides/metrics.md): `loss/<name>`, and `cov/<stat>`
# for
# the covariance statistics; selection metrics already carry their `select/` prefix.
_COV_PREFIX = "cov_"


def metric_name(key: str) -> str:
    if "/" in key:
        return key
    return f"cov/{key[len(_COV_PREFIX) :]}" if key.startswith(_COV_PREFIX) else f"loss/{key}"


def build_settings(
    name: str, params: Mapping[str, Any] | None = None, objectives: Mapping[str, Mapping[str, Any]] | None = None
) -> tuple[Any, SimpleNamespace]:
    """The objective's config instance and the settings of every objective (for the one its `within` points to),
    validated; errors are ValueErrors in one line naming the flag."""
    if name not in OBJECTIVES:
        raise ValueError(f"--objective: {unknown_objective(name)}")
    overrides = {key: dict(values) for key, values in (objectives or {}).items()}
    overrides[name] = {**overrides.get(name, {}), **(params or {})}
    settings = {}
    for key, obj in OBJECTIVES.items():
        given = overrides.pop(key, {})
        fields = {f.name for f in dataclasses.fields(obj.config)}
        for field in given:
            if field not in fields:
                flag = f"--objective.{field}" if key == name else f"--objective.{key}.{field}"
                known = ", ".join(sorted(fields)) or "none"
                raise ValueError(f"{flag}: objective {key!r} has no setting {field!r} (its settings: {known})")
        settings[key] = obj.config(**given)
    if overrides:
        unknown = next(iter(overrides))
        raise ValueError(f"--objective.{unknown}.*: no objective {unknown!r}; registered: {', '.join(OBJECTIVES)}")
    loss_cfg = SimpleNamespace(type=name, **settings)
    try:
        chain = within_chain(name, loss_cfg)
    except ValueError as e:
        raise ValueError(f"--objective.within {e}") from None
    for key in chain:
        errors = OBJECTIVES[key].validate(getattr(loss_cfg, key), None)
        if errors:
            prefix = "--objective." if key == name else f"--objective.{key}."
            raise ValueError("; ".join(e.replace(f"--loss.{key}.", prefix) for e in errors))
    return getattr(loss_cfg, name), loss_cfg


FLAG = "--algo.advantage.is_correction"  # OpenRLHF's flags: FLAG + "_level", "_mode", "_gating", "_threshold"


def off_policy_from_openrlhf(
    level: str, mode: str, gating: str, threshold: tuple[float, float] | list[float]
) -> OffPolicyConfig | None:
    """OpenRLHF's train/rollout correction flags as this project's `OffPolicyConfig` (None: level off).

    With the ratio gate OpenRLHF's three settings are ours exactly (docs/algorithms/off_policy.md, "The OpenRLHF
    route"):
    - token clip: the ratio clamped into [low, high], nothing dropped: `is_level token, is_min low, is_max high`;
    - token mask: tokens whose ratio leaves [low, high] get 0, the others their full ratio: `is_level token,
      is_max inf, reject token, reject_min low, reject_max high`;
    - seq mask: the same per response, gated on the geometric mean of its ratios: `reject sequence_geo`.
    The binary_kl and tv gates read another statistic than the ratio, which our correction does not compute: refused,
    naming the flag. A ValueError in one line, naming OpenRLHF's flag."""
    if level == "off":
        return None
    if gating != "ratio":
        raise ValueError(
            f"{FLAG}_gating {gating}: with --objective our off-policy correction replaces OpenRLHF's, and it gates "
            f"on the ratio pi_train / pi_rollout only; use {FLAG}_gating ratio, or {FLAG}_level off"
        )
    if len(threshold) != 2:
        raise ValueError(f"{FLAG}_threshold takes LOW HIGH, got {list(threshold)}")
    low, high = (float(x) for x in threshold)
    if mode == "clip":
        if level != "token":
            raise ValueError(f"{FLAG}_mode clip requires {FLAG}_level token")
        fields = dict(is_level="token", is_min=low, is_max=high)
    else:
        reject = "token" if level == "token" else "sequence_geo"
        fields = dict(is_level="token", is_max=math.inf, reject=reject, reject_min=low, reject_max=high)
    try:
        return OffPolicyConfig(**fields)
    except ValueError as e:  # a band without ratio 1 in it, a reversed band: the bounds are the threshold's
        raise ValueError(f"{FLAG}_threshold {low:g} {high:g}: {str(e).partition(': ')[2]}") from None


def openrlhf_filter_ratio(out: OffPolicyResult, mask: torch.Tensor, cfg: OffPolicyConfig) -> float:
    """OpenRLHF's is_filter_ratio from our correction's result: the share of units its gate filtered, over the valid
    tokens at token level (clamped ones in clip mode, dropped ones in mask mode), over the responses at sequence
    level, where a response without valid tokens counts as filtered (OpenRLHF's NaN statistic fails its gate)."""
    if cfg.reject == "sequence_geo":
        return float((~out.keep.any(dim=-1)).float().mean())
    m = out.metrics
    if cfg.reject == "none":
        return m["offpolicy/clipped_high_frac"] + m["offpolicy/clipped_low_frac"]
    return m["offpolicy/rejected_frac"]


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _clip_fraction(metrics: dict[str, float]) -> float:
    """OpenRLHF's `clip_ratio` is the fraction of tokens whose gradient the PPO clip removes; for our objectives,
    the fraction their own clip holds (0 for KL-Cov, which does not clip)."""
    if "ppo_clip_frac_low" in metrics or "ppo_clip_frac_high" in metrics:
        return metrics.get("ppo_clip_frac_low", 0.0) + metrics.get("ppo_clip_frac_high", 0.0)
    if "ce_gppo_clip_frac_low" in metrics:  # the tokens PPO's clip would hold: the authors' pg_clipfrac
        return metrics["ce_gppo_clip_frac_low"] + metrics["ce_gppo_clip_frac_high"]
    # DPPO's masked tokens are the ones its trust region stops; SAPO clips nothing (0, as verl reports it)
    for key in ("cispo_clip_frac", "gspo_clip_frac", "dppo_masked_frac"):
        if key in metrics:
            return metrics[key]
    return 0.0


class ObjectivePolicyLoss(nn.Module):
    """OpenRLHF's `PolicyLoss` interface around one of our registered objectives.

    `install()` makes a subclass with the class attributes below filled in; OpenRLHF then constructs it with its own
    arguments (`ActorPPOTrainer.__init__`) and calls it as it calls `PolicyLoss`.
    """

    objective: ClassVar[str] = ""
    params: ClassVar[Any] = None  # the objective's config dataclass instance
    loss_cfg: ClassVar[Any] = None  # settings of every objective, for the one a `within` points to
    seed: ClassVar[int | None] = None  # Clip-Cov's draw; None: the seed OpenRLHF gave torch (--train.seed)

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: tuple[float, float] | list[float] = (0.5, 5.0),
    ) -> None:
        super().__init__()
        if not self.objective:
            raise TypeError("ObjectivePolicyLoss is built by entropy_openrlhf.integrations.openrlhf.install()")
        if policy_loss_type != "ppo":
            # OpenRLHF's gspo switches its own loss; here the objective is the loss, so two choices would conflict
            raise ValueError(
                f"--actor.policy_loss_type {policy_loss_type}: the objective {self.objective!r} replaces OpenRLHF's "
                f"policy loss; leave it at ppo (for GSPO use the objective gspo)"
            )
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"--actor.dual_clip must be > 1, got {dual_clip}")
        if is_correction_level not in {"off", "token", "seq"}:
            raise ValueError(f"is_correction_level must be off/token/seq, got {is_correction_level}")
        if is_correction_mode not in {"mask", "clip"}:
            raise ValueError(f"is_correction_mode must be mask/clip, got {is_correction_mode}")
        threshold = tuple(float(x) for x in is_correction_threshold)
        # the correction our trainer applies, from OpenRLHF's flags (refuses the gates it has no equivalent of)
        self.off_policy = off_policy_from_openrlhf(
            is_correction_level, is_correction_mode, is_correction_gating, threshold
        )

        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.dual_clip = dual_clip
        self.token_level_loss = token_level_loss
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = threshold

        self.needs_entropy = objective_needs_entropy(self.objective, self.loss_cfg)
        # set by the training_step wrapper from the actor's forward, consumed by the next call
        self.entropy: torch.Tensor | None = None
        # the last call's metrics (objective and selection), read by the training_step wrapper
        self.last_metrics: dict[str, float] = {}
        self.last_shape: tuple[int, ...] | None = None
        self._generator: torch.Generator | None = None

    def generator(self) -> torch.Generator:
        """Clip-Cov's random draw: one generator per rank, seeded from --train.seed (which OpenRLHF has given torch
        before it builds the trainer) and the rank, advanced by every call: a run draws the same tokens again."""
        if self._generator is None:
            seed = self.seed if self.seed is not None else torch.initial_seed()
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self._generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + rank) % (2**63))
        return self._generator

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | torch.Tensor | None = None,
        global_batch_size: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        mask = torch.ones_like(log_probs) if action_mask is None else action_mask
        self.last_shape = tuple(log_probs.shape)

        weights = is_filter_ratio = vllm_kl = None
        correction_metrics: dict[str, float] = {}
        if self.off_policy is not None:
            if rollout_log_probs is None:
                raise ValueError("--algo.advantage.is_correction_level needs the rollout log-probs, and none came")
            correction = correct(old_log_probs, rollout_log_probs, mask, self.off_policy)
            weights = correction.weights
            device = log_probs.device
            is_filter_ratio = torch.tensor(openrlhf_filter_ratio(correction, mask, self.off_policy), device=device)
            # OpenRLHF's vllm_kl: the mean of log pi_rollout - log pi_train over the valid tokens, our kl_k1
            vllm_kl = torch.tensor(correction.metrics["offpolicy/kl_k1"], device=device)
            # OpenRLHF averages every status metric; a maximum would read as a mean there
            correction_metrics = {k: v for k, v in correction.metrics.items() if k != "offpolicy/weight_max"}

        entropy, self.entropy = self.entropy, None
        if self.needs_entropy and entropy is None:
            raise ValueError(
                f"objective {self.objective!r} selects by token entropy and this call brought none: call the loss "
                "from ActorPPOTrainer.training_step after install() (it captures the actor's entropy there), or set "
                "`.entropy` to a tensor shaped like log_probs first"
            )
        if entropy is not None and entropy.shape != log_probs.shape:
            raise ValueError(f"entropy {tuple(entropy.shape)} does not match log_probs {tuple(log_probs.shape)}")

        ctx = LossContext(
            clip_low=self.clip_eps_low,
            clip_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            agg="token_mean" if self.token_level_loss else "seq_mean_token_mean",
            tokens=_as_float(batch_num_tokens),
            sequences=_as_float(global_batch_size),
            # OpenRLHF scales by dp_size only together with a global normaliser; so does our aggregation
            dp_size=int(dp_size),
            # DeepSpeed divides every micro-batch's loss by the accumulation steps itself (OpenRLHF's batch_num_tokens
            # is pre-divided for that); an objective that averages per micro-batch must not divide again
            micro_batches=1,
            generator=self.generator(),
        )
        out, selection_metrics = run_objective(
            self.objective, self.params, self.loss_cfg, ctx, log_probs, old_log_probs, advantages, mask,
            entropy=entropy, is_weights=weights,
        )  # fmt: skip

        metrics = {metric_name(k): v for k, v in {**out.metrics, **selection_metrics}.items()}
        metrics.update(correction_metrics)
        self.last_metrics = metrics

        device = out.loss.device
        clip_ratio = torch.tensor(_clip_fraction(out.metrics), device=device)
        # OpenRLHF's ppo_kl (k1, old - new, over the valid tokens), whatever the objective: its own logs keep their
        # meaning; the objective's own version (|d| for KL-Cov) is logged as loss/ppo_kl
        m = mask.float()
        ppo_kl = ((old_log_probs.detach().float() - log_probs.detach().float()) * m).sum() / m.sum().clamp(min=1)
        return out.loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio


def make_policy_loss(name: str, params: Any, loss_cfg: SimpleNamespace, seed: int | None) -> type[ObjectivePolicyLoss]:
    """A PolicyLoss class bound to objective `name` with `params`."""
    return type(
        f"ObjectivePolicyLoss_{name}",
        (ObjectivePolicyLoss,),
        {"objective": name, "params": params, "loss_cfg": loss_cfg, "seed": seed, "__module__": __name__},
    )


# --------------------------------------------------------------------------- around ActorPPOTrainer.training_step


@contextlib.contextmanager
def capture_entropy(actor: nn.Module, loss_fn: ObjectivePolicyLoss) -> Iterator[None]:
    """For the duration of one training_step, make the actor's forward also return its token entropy (OpenRLHF
    computes it only with --actor.entropy_coef) and hand it to the loss, aligned as training_step aligns it."""
    forward = actor.forward

    def forward_with_entropy(sequences, action_mask=None, *args, **kwargs):
        kwargs["return_entropy"] = True
        result = forward(sequences, action_mask, *args, **kwargs)
        if isinstance(result, tuple) and action_mask is not None:
            output = result[1]
            loss_fn.entropy = output.entropy[:, -action_mask.shape[1] :].detach()
        return result

    # an instance attribute shadows the class's forward for nn.Module.__call__; removed again below
    actor.forward = forward_with_entropy
    try:
        yield
    finally:
        del actor.forward


def wrap_training_step(original: Callable) -> Callable:
    """training_step, plus our objective's metrics in its status (token-weighted, as OpenRLHF weighs its 0-d
    metrics when ppo_train reduces them over micro-batches and ranks) and the entropy capture when needed."""

    @functools.wraps(original)
    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        loss_fn = getattr(self, "actor_loss_fn", None)
        if not isinstance(loss_fn, ObjectivePolicyLoss):
            return original(self, experience, kl_ctl, step, loss_batch_info)
        loss_fn.last_metrics = {}
        capture = capture_entropy(self.actor, loss_fn) if loss_fn.needs_entropy else contextlib.nullcontext()
        with capture:
            status = original(self, experience, kl_ctl, step, loss_batch_info)
        for key, value in loss_fn.last_metrics.items():
            if math.isfinite(value):
                status["metrics"][key] = torch.tensor(float(value))
                status["weights"][key] = "token"
        return status

    training_step.__entropy_openrlhf_wrapped__ = original
    return training_step
