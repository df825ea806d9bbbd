"""What an objective is, and the registry that holds them by name.

An objective is three things: a config dataclass (its own settings, which become `--loss.<name>.<field>` flags),
an optional token selector (which tokens it acts on) and a loss over typed inputs. The trainer never branches on
an objective's name: it asks the registry for the objective named by `--loss.type`, runs its selector (per
micro-batch, or once over the whole optimizer mini-batch on all ranks with `--loss.scope global`) and its loss.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from entropy_openrlhf.algorithms.advantages import entropy_advantage, entropy_advantage_metrics
from entropy_openrlhf.algorithms.loss_terms import LossOutput
from entropy_openrlhf.options import choice_errors


@dataclass(frozen=True)
class TokenBatch:
    """The per-token inputs of one loss call, (B, L) tensors on the same grid (one micro-batch, or a (1, N) row of
    tokens pooled over a mini-batch when selecting globally)."""

    log_probs: torch.Tensor  # current policy; carries the gradient in a loss call
    old_log_probs: torch.Tensor  # the policy this rollout batch's optimizer steps start from
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 on response tokens
    entropy: torch.Tensor | None = None  # current policy's token entropy, detached; only for objectives that ask
    is_weights: torch.Tensor | None = None  # truncated importance weights (async runs), multiplied into the loss


@dataclass
class LossContext:
    """What one loss call needs to know beyond its micro-batch."""

    # the PPO clip shared by the objectives that have one (--loss.clip_low/high, --loss.dual_clip)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token_mean"  # --loss.agg
    agg_norm_len: float = 0.0  # --loss.agg_norm_len: seq_mean_token_sum_norm's constant length (0: the batch width)
    # counts over the whole optimizer mini-batch on all ranks; None = this call's own (a plain function call)
    tokens: float | None = None
    sequences: float | None = None
    dp_size: int = 1
    micro_batches: int = 1  # micro-batches per mini-batch on this rank
    selected: torch.Tensor | None = None  # a selection made over a wider scope, for this micro-batch
    selected_total: float | None = None  # its size over the whole mini-batch on all ranks
    cov_means: tuple[float, float] | None = None  # (advantage mean, log-prob mean) of that wider scope
    generator: torch.Generator | None = None  # Clip-Cov's random draw, seeded by the trainer
    # (alpha, kappa) of the entropy-based advantage (--algo.entropy_adv_alpha/kappa), applied to the advantages
    # before the selection and the loss; None = off
    entropy_adv: tuple[float, float] | None = None

    @property
    def normalizer(self) -> float | None:
        """The denominator --loss.agg asks for, over the whole mini-batch: its tokens, its sequences, or (Dr.GRPO's
        seq_mean_token_sum_norm) its sequences times the constant length."""
        if self.agg == "token_mean":
            return self.tokens
        if self.agg == "seq_mean_token_sum_norm" and self.sequences is not None:
            if self.agg_norm_len <= 0:
                raise ValueError("seq_mean_token_sum_norm over a whole mini-batch needs agg_norm_len > 0")
            return self.sequences * self.agg_norm_len
        return self.sequences


# select(batch, params, ctx, candidates) -> bool mask of batch.mask's shape
Selector = Callable[[TokenBatch, Any, LossContext, "torch.Tensor | None"], torch.Tensor]
LossFn = Callable[[TokenBatch, Any, LossContext], LossOutput]


@dataclass(frozen=True)
class Knob:
    """A setting the entropy controller may scale: value = base * scale ** direction, capped at `cap`."""

    field: str
    direction: int = 1  # +1: more of it raises entropy; -1: less of it does
    cap: float | None = None  # ratios and fractions stay <= 1


@dataclass(frozen=True)
class Objective:
    name: str
    config: type  # dataclass of the objective's own settings
    loss: LossFn
    select: Selector | None = None
    needs_entropy: bool = False  # its selector or loss reads TokenBatch.entropy
    knobs: tuple[Knob, ...] = ()  # what --entropy.target may scale; the first is the default
    summary: str = ""  # one line for --help and the docs
    # validate(params, cfg) -> error strings "--loss.<name>.<field>: why"; notes(params, cfg) -> warnings
    validate: Callable[[Any, Any], list[str]] = lambda params, cfg: []
    notes: Callable[[Any, Any], list[str]] = lambda params, cfg: []
    # run_note(params, metrics) -> what the run prints once when the objective's selection has sat at its one-token
    # floor for several steps in a row (`loss/select_starved`; metrics: the last such step's), or None to stay quiet
    run_note: Callable[[Any, dict[str, float]], str | None] = lambda params, metrics: None

    def knob(self, name: str = "") -> Knob:
        if not self.knobs:
            raise ValueError(f"objective {self.name!r} has no strength for --entropy.target to scale")
        for k in self.knobs:
            if k.field == name or not name:
                return k
        raise ValueError(
            f"--entropy.knob {name!r}: objective {self.name!r} can scale {', '.join(k.field for k in self.knobs)}"
        )

    def scaled(self, params: Any, scale: float, knob: str = "") -> Any:
        """A copy of `params` with the controlled knob multiplied by scale (divided, for direction -1)."""
        if scale == 1.0:
            return params
        k = self.knob(knob)
        value = getattr(params, k.field) * scale**k.direction
        if k.cap is not None:
            value = min(value, k.cap)
        return dataclasses.replace(params, **{k.field: value})


OBJECTIVES: dict[str, Objective] = {}


def register_objective(
    name: str,
    config: type,
    *,
    select: Selector | None = None,
    needs_entropy: bool = False,
    knobs: tuple[Knob, ...] = (),
    summary: str = "",
    validate: Callable[[Any, Any], list[str]] | None = None,
    notes: Callable[[Any, Any], list[str]] | None = None,
    run_note: Callable[[Any, dict[str, float]], str | None] | None = None,
) -> Callable[[LossFn], LossFn]:
    """Decorator over an objective's loss function: registers it under `name` with its config and selector."""
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"objective {name!r}: its config must be a dataclass, got {config!r}")

    def wrap(loss: LossFn) -> LossFn:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered twice")
        own = validate or (lambda params, cfg: [])

        def checked(params: Any, cfg: Any) -> list[str]:  # the choices its options declare, then its own rules
            return choice_errors(params, f"loss.{name}") + own(params, cfg)

        hooks = {"notes": notes, "run_note": run_note}
        checks = {"validate": checked, **{k: f for k, f in hooks.items() if f is not None}}
        OBJECTIVES[name] = Objective(name, config, loss, select, needs_entropy, knobs, summary, **checks)
        return loss

    return wrap


def unknown_objective(name: str) -> str:
    """Why `name` is no objective: the registered names, and the nearest when it looks like a misspelling."""
    close = difflib.get_close_matches(name, list(OBJECTIVES), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown objective {name!r}; registered: {', '.join(OBJECTIVES)}{hint}"


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise KeyError(unknown_objective(name))
    return OBJECTIVES[name]


# --------------------------------------------------------------------------- selection, composed


def within_of(params: Any) -> str:
    """The selector another objective's selection is restricted to (`--loss.<name>.within`), or ""."""
    return getattr(params, "within", "") or ""


def within_chain(name: str, loss_cfg: Any) -> list[str]:
    """`name` and the objectives its `within` setting leads to, in order. Raises ValueError, its message starting
    with the bad value, unless each names another objective that selects tokens and the chain has no loop. The
    config and the OpenRLHF adapter both check `within` here, each prefixing its own flag."""
    chain = [name]
    within = within_of(getattr(loss_cfg, name))
    while within:
        if within not in OBJECTIVES or OBJECTIVES[within].select is None or within in chain:
            selectors = [k for k, o in OBJECTIVES.items() if o.select is not None and k != name]
            raise ValueError(f"{within!r}: must name another selecting objective: {', '.join(selectors)}")
        chain.append(within)
        within = within_of(getattr(loss_cfg, within))
    return chain


def objective_needs_entropy(name: str, loss_cfg: Any) -> bool:
    """Whether running `name` (with what its `within` points to) needs the token entropy."""
    obj = get_objective(name)
    within = within_of(getattr(loss_cfg, name))
    return obj.needs_entropy or (bool(within) and objective_needs_entropy(within, loss_cfg))


def select_tokens(
    name: str, params: Any, loss_cfg: Any, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The tokens objective `name` acts on (None when it has no selector), and selection metrics.

    With `--loss.<name>.within other`, the choice is restricted to the tokens `other`'s selector picks (its own
    settings from `loss_cfg`); the unrestricted choice is made too, on a copy of the generator, so that the overlap
    of the two selections (`select/overlap_cov_entropy`) is logged.
    """
    obj = get_objective(name)
    if obj.select is None:
        return None, {}
    within = within_of(params)
    if not within:
        return obj.select(batch, params, ctx, None), {}
    inner, _ = select_tokens(within, getattr(loss_cfg, within), loss_cfg, batch, ctx)
    free_ctx = copy.copy(ctx)
    if ctx.generator is not None:
        free_ctx.generator = torch.Generator().set_state(ctx.generator.get_state())
    free = obj.select(batch, params, free_ctx, None)
    restricted = obj.select(batch, params, ctx, inner)
    n_free = int(free.sum())
    overlap = float((free & inner).sum()) / n_free if n_free else 0.0
    return restricted, {"select/overlap_cov_entropy": overlap, "select/within_frac": _frac(inner, batch.mask)}


def _frac(selected: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.bool().sum())
    return float(selected.sum()) / n if n else 0.0


# --------------------------------------------------------------------------- one loss call


def run_objective(
    name: str,
    params: Any,
    loss_cfg: Any,
    ctx: LossContext,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[LossOutput, dict[str, float]]:
    """One micro-batch through objective `name`: its TokenBatch, its selection, its loss. The policy actor and the
    OpenRLHF adapter both call this, so the two run an objective the same way.

    A selection already in `ctx.selected` (made over the whole mini-batch, `--loss.scope global`) is used as it is;
    otherwise the objective's selector, if it has one, chooses over this micro-batch. With `ctx.entropy_adv` the
    advantages are first shaped by `entropy_advantage` with this call's `entropy` (the current policy's), and the
    selection and the loss both see the shaped ones; the shaping's metrics join the loss's. Returns the loss output
    and the selection's metrics (empty when nothing was selected here).
    """
    objective = get_objective(name)
    shaping: dict[str, float] = {}
    if ctx.entropy_adv is not None:
        if entropy is None:
            raise ValueError("the entropy-based advantage (--algo.entropy_adv_alpha) needs the token entropy")
        alpha, kappa = ctx.entropy_adv
        shaping = entropy_advantage_metrics(advantages, entropy, mask, alpha=alpha, kappa=kappa)
        advantages = entropy_advantage(advantages, entropy, mask, alpha=alpha, kappa=kappa)
    batch = TokenBatch(log_probs, old_log_probs, advantages, mask, entropy=entropy, is_weights=is_weights)
    selection_metrics: dict[str, float] = {}
    if ctx.selected is None and objective.select is not None:
        selected, selection_metrics = select_tokens(name, params, loss_cfg, batch, ctx)
        ctx = dataclasses.replace(ctx, selected=selected)
    out = objective.loss(batch, params, ctx)
    out.metrics.update(shaping)
    return out, selection_metrics
