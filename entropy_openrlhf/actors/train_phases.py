"""The phases of one RL step on a policy rank, in the order PolicyActor.train_step runs them:

1. `prepare_step`: the rank's shard cut into `train.mini_batches` mini-batches of micro-batches (the sizes the
   driver's layout gives, micro_batches.py), on the device, with their per-token grids and the objective's settings
   for this step;
2. `old_log_probs`: the no-grad pass, old log-probs and token entropies with the weights the step starts from;
   `observe_old` turns them into metrics and, through `algorithms.off_policy.correct` (`--offpolicy.*`), into the
   per-token weights of the off-policy correction. Under `--offpolicy.bypass` pi_old is the rollout's log-probs and
   this pass does not run: each training forward gives its micro-batch's entropies and metrics instead;
3. `optimizer_step`, once per mini-batch: the objective's selection over the whole mini-batch when it is global
   (`select_globally`), then forward, loss and backward per micro-batch (`train_micro_batch`), and one optimizer step,
   the loss normalised over the whole mini-batch on all ranks so that micro-batching and sharding do not change it;
4. `step_result`: the step's metrics on this rank.

Every forward here runs at `--rollout.temperature` (logits / T before the log-softmax and the entropy), the
distribution vLLM sampled from and returns log-probs of; `response_log_probs`, the weight-sync check's, stays at T = 1
like the engine's prompt log-probs it is compared with.

Plain functions over the rank's fixed facts (`RankSetup`), the DeepSpeed engine and the step's state (`StepState`),
which the phases fill in; the actor keeps the state and decides which phase runs when. Actor-only: it loads OpenRLHF
(transformers reads its settings on import), so only a policy rank imports it, after `set_cpu_defaults`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from entropy_openrlhf.actors.forward import (
    SeqBatch,
    forward_log_probs,
    log_probs_by_micro_batch,
    make_seq_batch,
    to_token_grid,
)
from entropy_openrlhf.actors.lora import adapter_off
from entropy_openrlhf.actors.micro_batches import fixed_layout
from entropy_openrlhf.actors.step_data import TrainSample, reduce_micro_batches
from entropy_openrlhf.algorithms.advantages import entropy_advantage
from entropy_openrlhf.algorithms.losses import aggregate, entropy_bonus
from entropy_openrlhf.algorithms.metrics import entropy_stats, turn_entropy_stats
from entropy_openrlhf.algorithms.objectives import (
    LossContext,
    TokenBatch,
    get_objective,
    objective_needs_entropy,
    run_objective,
    select_tokens,
)
from entropy_openrlhf.algorithms.off_policy import (
    OffPolicyConfig,
    correct,
    metrics_by_staleness,
    selection_by_staleness,
)
from entropy_openrlhf.algorithms.selection import pooled_selection
from entropy_openrlhf.compat import ensure_flash_attn_importable
from entropy_openrlhf.config import Config

ensure_flash_attn_importable()
from openrlhf.models.utils import compute_approx_kl  # noqa: E402  (needs the flash-attn stand-in first)


@dataclass(frozen=True)
class RankSetup:
    """What the phases read of the rank they run on, fixed when the actor starts."""

    cfg: Config
    rank: int
    world_size: int
    pad_id: int


@dataclass
class StepState:
    """One train step on this rank: its settings, its micro-batches (mini-batch m is micro-batches `minis[m]`; an
    empty stand-in's mask is all 0) with their per-token grids, and what the step learns of them (old log-probs,
    entropies, IS weights, metrics) as it goes."""

    step: int
    params: Any  # the objective's settings, scaled by the entropy controller
    off_policy: OffPolicyConfig  # the correction (`Config.off_policy`); with bypass, old_lp is the rollout's
    select_globally: bool
    needs_entropy: bool
    bonus_coef: float
    minis: list[list[int]]  # the micro-batch indices of each mini-batch
    batches: list[SeqBatch]
    advantages: list[torch.Tensor]
    rollout_lp: list[torch.Tensor]
    ref_lp: list[torch.Tensor] | None
    old_lp: list[torch.Tensor | None]
    entropies: list[torch.Tensor | None]
    is_weights: list[torch.Tensor | None]
    staleness: list[torch.Tensor]  # per micro-batch, (B, L): policy versions each response token lags the trainer
    ages: set[int] = field(default_factory=set)  # the staleness values of every token this rank trains on
    # per micro-batch, each response's data source where the step mixes several, else "" (TrainSample.data_source)
    sources: list[list[str]] = field(default_factory=list)
    # per micro-batch, (B, L): each response token's turn in a tool episode (TrainSample.token_turns); None: one turn
    turns: list[torch.Tensor] | None = None
    epochs: int = 1  # passes over the mini-batches (`--train.ppo_epochs`), each mini-batch one optimizer step per pass
    metrics: dict[str, list[float]] = field(default_factory=dict)
    lr: float = 0.0  # the learning rate the last optimizer step applied (optimizer_step)

    def add(self, key: str, value: float) -> None:
        self.metrics.setdefault(key, []).append(float(value))


def _stand_in(pad_id: int) -> TrainSample:
    """An empty micro-batch's one sequence: a pad token answered by a pad token, masked out of everything. Its
    forward and backward are the collectives this rank owes the others (micro_batches.py)."""
    return TrainSample([pad_id], [pad_id], 0.0, [0.0], ref_log_probs=[0.0], response_mask=[0])


def make_batch(setup: RankSetup, engine: Any, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> SeqBatch:
    """Prompts + responses as one right-padded batch on the engine's device, laid out for a shared prefix when
    `--train.shared_prefix` packs them."""
    return make_seq_batch(
        prompt_ids, response_ids, setup.pad_id, shared_prefix=setup.cfg.train.shared_prefix,
        model_config=engine.module.config,
    ).to(engine.device)  # fmt: skip


def response_log_probs(
    setup: RankSetup, engine: Any, prompt_ids: list[list[int]], response_ids: list[list[int]]
) -> list[list[float]]:
    """The current weights' log-prob of each response token, one list per response (no grad; outside any step), at
    T = 1: the engine's `sequence_log_probs` it is checked against are raw prompt log-probs, never temperature-scaled
    (vLLM's prompt log-probs skip the sampler)."""
    b = make_batch(setup, engine, prompt_ids, response_ids)
    engine.eval()
    with torch.no_grad():
        lp, _ = forward_log_probs(engine, b)
    return [lp[i][b.mask[i].bool()].float().tolist() for i in range(len(prompt_ids))]


def reference_log_probs(
    setup: RankSetup, engine: Any, prompt_ids: list[list[int]], response_ids: list[list[int]], sizes: list[int]
) -> list[list[float]]:
    """LoRA's reference on this rank: the base model's log-probs (the adapter switched off), from micro-batches of
    `sizes` (0: a stand-in), at the sampling temperature, as a reference rank gives them (reference_model.py)."""
    engine.eval()
    with adapter_off(engine.module):
        return log_probs_by_micro_batch(
            engine, lambda p, r: make_batch(setup, engine, p, r), prompt_ids, response_ids, sizes,
            temperature=setup.cfg.rollout.temperature, pad_id=setup.pad_id,
        )  # fmt: skip


# ------------------------------------------------------------------ 1. preparing the step


def prepare_step(
    setup: RankSetup,
    engine: Any,
    samples: list[TrainSample],
    step: int,
    strength_scale: float,
    entropy_coef: float | None,
    micro_sizes: list[list[int]] | None = None,
) -> StepState:
    """The shard cut into mini-batches of micro-batches, on the device, with their per-token grids, and the
    settings of the objective for this step (`strength_scale`, `entropy_coef`: PolicyActor.train_step).
    `micro_sizes[m]`: the sizes of mini-batch m's micro-batches, in the shard's order (the driver's layout; 0 is an
    empty stand-in that keeps this rank in step with the others); None: equal mini-batches of
    `--actor.micro_batch_size` sequences."""
    cfg = setup.cfg
    if micro_sizes is None:
        micro_sizes = fixed_layout(len(samples), cfg.train.mini_batches, 1, cfg.actor.micro_batch_size).sizes(0)
    if len(micro_sizes) != cfg.train.mini_batches or sum(map(sum, micro_sizes)) != len(samples):
        raise ValueError(
            f"rank {setup.rank}: micro-batch sizes {micro_sizes} do not cut {len(samples)} samples into "
            f"{cfg.train.mini_batches} mini-batches"
        )
    micro: list[list[TrainSample]] = []
    minis: list[list[int]] = []
    start = 0
    for sizes in micro_sizes:
        minis.append(list(range(len(micro), len(micro) + len(sizes))))
        for n in sizes:
            micro.append(samples[start : start + n] or [_stand_in(setup.pad_id)])
            start += n
    batches = [make_batch(setup, engine, [s.prompt_ids for s in m], [s.response_ids for s in m]) for m in micro]

    def grid(values_of: Callable[[TrainSample], list[float]]) -> list[torch.Tensor]:
        """One value per response token, as a (B, L) tensor per micro-batch."""
        return [
            to_token_grid([values_of(s) for s in m], b, [len(s.prompt_ids) for s in m]).to(b.mask.device)
            for m, b in zip(micro, batches)
        ]

    # the response masks narrow the loss mask: a masked token is in no loss, no normaliser and no metric
    if any(s.response_mask is not None for m in micro for s in m):
        masks = grid(lambda s: s.response_mask if s.response_mask is not None else [1] * len(s.response_ids))
        for b, keep in zip(batches, masks):
            narrowed = b.mask * keep.to(b.mask.dtype)
            if b.packed is not None:  # the packed forwards read one source per valid cell: drop the masked ones
                b.packed = b.packed.narrowed(b.mask, narrowed)
            b.mask = narrowed

    has_ref = all(s.ref_log_probs is not None for s in samples)
    lc = cfg.loss
    objective = get_objective(lc.type)
    off_policy = cfg.off_policy
    rollout_lp = grid(lambda s: s.rollout_log_probs)
    multi_turn = any(s.token_turns is not None for s in samples)
    turns = grid(lambda s: s.token_turns or [1] * len(s.response_ids)) if multi_turn else None
    return StepState(
        step=step,
        params=objective.scaled(getattr(lc, lc.type), strength_scale, cfg.entropy.knob),
        off_policy=off_policy,
        select_globally=lc.scope == "global" and objective.select is not None,
        # the entropy-based advantage shapes every loss call's advantages with the training forward's entropy
        needs_entropy=objective_needs_entropy(lc.type, lc) or cfg.algo.entropy_adv() is not None,
        bonus_coef=lc.entropy_coef if entropy_coef is None else float(entropy_coef),
        minis=minis,
        epochs=cfg.train.ppo_epochs,
        batches=batches,
        advantages=grid(lambda s: [s.advantage] * len(s.response_ids)),
        rollout_lp=rollout_lp,
        ref_lp=grid(lambda s: s.ref_log_probs) if has_ref else None,
        # bypass: pi_old is the policy that sampled the responses, so PPO's ratio is pi_theta / pi_rollout
        old_lp=list(rollout_lp) if off_policy.bypass else [None] * len(batches),
        entropies=[None] * len(batches),
        is_weights=[None] * len(batches),
        staleness=grid(lambda s: s.token_staleness or [s.staleness] * len(s.response_ids)),
        sources=[[s.data_source for s in m] for m in micro],
        turns=turns,
        ages={a for x in samples for a in (x.token_staleness or [x.staleness])},
    )


# ------------------------------------------------------------------ 2. old log-probs


def old_log_probs(setup: RankSetup, engine: Any, s: StepState, indices: Sequence[int]) -> None:
    """The no-grad pass: old log-probs and token entropies of the micro-batches `indices`, then their metrics."""
    engine.eval()
    temperature = setup.cfg.rollout.temperature
    with torch.no_grad():
        for i in indices:
            lp, s.entropies[i] = forward_log_probs(engine, s.batches[i], temperature=temperature, with_entropy=True)
            s.old_lp[i] = lp.float()
    for i in indices:
        observe_old(setup.cfg, s, i)


def observe_old(cfg: Config, s: StepState, i: int, current: torch.Tensor | None = None) -> None:
    """Micro-batch i's off-policy weights (`--offpolicy.*`), and the metrics of the current weights' log-probs
    (`current`; by default the old pass's, s.old_lp[i]) and of s.entropies[i] against the rollout's and the
    reference's. The objective multiplies each token's loss by its weight (run_objective's `is_weights`); a rejected
    token's weight is 0 and it stays in the mask, hence in the normaliser (docs/algorithms/off_policy.md)."""
    b, r = s.batches[i], s.rollout_lp[i]
    lp = s.old_lp[i] if current is None else current
    op = s.off_policy
    out = correct(lp, r, b.mask, op)
    # without a weight or a rejection every valid token weighs 1: nothing to multiply
    s.is_weights[i] = out.weights if op.weighs else None
    n = int(b.mask.sum())
    if n == 0:
        return
    es = entropy_stats(s.entropies[i], b.mask)
    s.add("entropy/token_mean", es["token_mean"])
    s.add("entropy/seq_mean", es["seq_mean"])
    # averaged as entropy/seq_mean is, over the micro-batches (and ranks) that hold the source; a state built
    # without sources (a benchmark's, a test's) has none
    sources = s.sources[i] if s.sources else []
    for source in sorted({name for name in sources if name}):
        rows = torch.tensor([name == source for name in sources], device=b.mask.device)
        if b.mask[rows].any():  # every token of the source masked (--loss.mask_truncated): no entropy, not a 0
            s.add(f"entropy/{source}/seq_mean", entropy_stats(s.entropies[i][rows], b.mask[rows])["seq_mean"])
    if s.turns is not None:  # tool episodes: entropy per turn, and right after each tool output
        for k, v in turn_entropy_stats(s.entropies[i], b.mask, s.turns[i], cfg.tools.post_tool_tokens).items():
            s.add(k, v)
    s.add("rollout/vllm_kl", float(((r - lp) * b.mask).sum() / n))
    # the weight-sync check: with max_staleness 0 the engine holds the trainer's weights, so only numerics
    gap = (r - lp).abs() * b.mask
    s.add("rollout/logprob_diff_max", float(gap.max()))
    s.add("rollout/logprob_diff_mean", float(gap.sum() / n))
    if s.ref_lp is not None:
        kl = compute_approx_kl(lp, s.ref_lp[i], kl_estimator=cfg.algo.kl_estimator)
        s.add("kl/ref", float((kl * b.mask).sum() / n))
    # under bypass `correct` sees no gap (pi_old is the rollout's): the gap shown is the current weights' against
    # the rollout's, with nothing reweighted (bypass admits no is_level or reject)
    shown = dataclasses.replace(op, bypass=False) if op.bypass else op
    for k, v in (correct(lp, r, b.mask, shown).metrics if op.bypass else out.metrics).items():
        s.add(k, v)
    # a staleness this rank trains on but this micro-batch lacks holds 0 of its tokens (`also`): the mean over
    # micro-batches is then the group's average share
    for k, v in metrics_by_staleness(lp, r, b.mask, s.staleness[i], shown, also=s.ages).items():
        s.add(k, v)


# ------------------------------------------------------------------ 3. the optimizer steps


def optimizer_step(
    setup: RankSetup, engine: Any, s: StepState, mini: int, old_from_training: bool, epoch: int = 0
) -> bool:
    """Mini-batch `mini` in pass `epoch` over the step's batch (`--train.ppo_epochs`): its selection (global scope),
    then forward, loss and backward per micro-batch, and one optimizer step. `old_from_training`: what the old pass
    gives (train_micro_batch) comes from these forwards. Whether DeepSpeed applied the step (it skips one whose
    gradient norm is NaN/Inf and leaves the weights as they were)."""
    lc = setup.cfg.loss
    # the rate this step applies: DeepSpeed steps the schedule after the optimizer step (policy_engine.py), so the
    # param groups hold the next step's afterwards
    s.lr = float(engine.optimizer.param_groups[0]["lr"])
    idx = s.minis[mini]
    local_tokens = sum(float(s.batches[i].mask.sum()) for i in idx)
    local_seqs = sum(float((s.batches[i].mask.sum(-1) > 0).sum()) for i in idx)
    tokens, sequences = _all_reduce_sum(engine.device, setup.world_size, local_tokens, local_seqs)
    base = LossContext(
        clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip or None, agg=lc.agg,
        agg_norm_len=lc.agg_norm_len or setup.cfg.rollout.max_new_tokens, tokens=tokens, sequences=sequences,
        dp_size=setup.world_size, micro_batches=max(1, sum(bool(s.batches[i].mask.any()) for i in idx)),
        entropy_adv=setup.cfg.algo.entropy_adv(),
    )  # fmt: skip
    selections: dict[int, torch.Tensor | None] = {i: None for i in idx}
    update = epoch * len(s.minis) + mini  # the step's optimizer steps so far, over its passes
    if s.select_globally:
        selections, base = select_globally(setup, engine, s, update, idx, base)
    for j, i in enumerate(idx):
        # the optimizer steps after the mini-batch's last micro-batch, however many this step has: said explicitly,
        # since a token budget varies the count DeepSpeed's gradient_accumulation_steps would assume
        engine.set_gradient_accumulation_boundary(j == len(idx) - 1)
        # micro_batch scope: selections[i] is None and the objective selects here
        ctx = dataclasses.replace(base, generator=_generator(setup, s.step, update, j), selected=selections[i])
        train_micro_batch(setup, engine, s, i, ctx, old_from_training)
    if not engine.was_step_applied():
        return False
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        s.add("train/grad_norm", float(grad_norm))
    return True


def select_globally(
    setup: RankSetup, engine: Any, s: StepState, update: int, idx: list[int], base: LossContext
) -> tuple[dict[int, torch.Tensor], LossContext]:
    """`--loss.scope global`: the objective's selection over the whole mini-batch (micro-batches `idx`) on all ranks
    for the step's optimizer step `update` (counted over its passes); the masks per micro-batch and the loss context
    that carries the pooled means and count."""
    temperature = setup.cfg.rollout.temperature
    # the weights have not moved yet this step: the old pass's values are current (under bypass there is none)
    if update == 0 and not s.off_policy.bypass:
        current = [(s.old_lp[i], s.entropies[i]) for i in idx]
    else:
        with torch.no_grad():
            current = [
                forward_log_probs(engine, s.batches[i], temperature=temperature, with_entropy=s.needs_entropy)
                for i in idx
            ]

    def advantages(i: int, entropy: torch.Tensor | None) -> torch.Tensor:
        """Micro-batch i's advantages as its loss call will see them: shaped by the entropy-based advantage when it
        is on, with the entropy of these weights (those of the training forwards to come), so that the selection
        and its covariance means are the loss's."""
        if base.entropy_adv is None:
            return s.advantages[i]
        alpha, kappa = base.entropy_adv
        return entropy_advantage(s.advantages[i], entropy, s.batches[i].mask, alpha=alpha, kappa=kappa)

    # the old pass computed the weights; s.off_policy.weighs is alike on every rank, so all gather the same rows
    pooled = [
        TokenBatch(
            lp.float(), s.old_lp[i], advantages(i, ent), s.batches[i].mask, entropy=ent, is_weights=s.is_weights[i]
        )
        for (lp, ent), i in zip(current, idx)
    ]
    lc, generator = setup.cfg.loss, _generator(setup, s.step, update, 0)

    def select(tokens: TokenBatch, means: tuple[float, float]):
        """The objective's selection over the pooled tokens (`pooled_selection`'s callback)."""
        ctx = dataclasses.replace(base, cov_means=means, generator=generator)
        return select_tokens(lc.type, s.params, lc, tokens, ctx)

    chosen = pooled_selection(pooled, select, with_entropy=s.needs_entropy, with_weights=s.off_policy.weighs)
    for k, v in chosen.metrics.items():
        s.add(k, v)
    context = dataclasses.replace(base, cov_means=chosen.means, selected_total=float(chosen.total))
    return dict(zip(idx, chosen.masks)), context


def train_micro_batch(
    setup: RankSetup, engine: Any, s: StepState, i: int, ctx: LossContext, old_from_training: bool
) -> None:
    """Forward, the objective's loss (plus the KL and entropy-bonus terms) and backward of micro-batch i.
    `old_from_training`: what the old pass would give of this micro-batch (entropies, metrics, off-policy weights
    and, unless bypass keeps the rollout's, the old log-probs) comes from this forward."""
    cfg, lc, b = setup.cfg, setup.cfg.loss, s.batches[i]
    if not b.mask.any():
        # an empty stand-in: a forward and a backward of zero, so that its collectives meet the other ranks'
        lp, _ = forward_log_probs(engine, b, temperature=cfg.rollout.temperature)
        if old_from_training:  # what the old pass would have left, for whatever reads it
            s.entropies[i] = torch.zeros_like(lp.detach())
            if not s.off_policy.bypass:
                s.old_lp[i] = lp.detach().float()
        engine.backward(lp.sum() * 0.0, scale_wrt_gas=False)
        engine.step()
        s.add("loss/policy", 0.0)
        return
    with_bonus = s.bonus_coef > 0  # at 0 no entropy gradient is computed: the bonus off costs nothing
    lp, ent = forward_log_probs(
        engine, b, temperature=cfg.rollout.temperature, with_entropy=s.needs_entropy or old_from_training,
        entropy_grad=with_bonus,
    )  # fmt: skip
    if old_from_training:
        current, s.entropies[i] = lp.detach().float(), ent.detach()
        if not s.off_policy.bypass:
            s.old_lp[i] = current
        observe_old(cfg, s, i, current)
    # the objective's selection reads the entropy detached; only the bonus differentiates it
    entropy = ent.detach() if s.needs_entropy else None
    out, selection_metrics = run_objective(
        lc.type, s.params, lc, ctx, lp, s.old_lp[i], s.advantages[i], b.mask, entropy=entropy,
        is_weights=s.is_weights[i],
    )  # fmt: skip
    for k, v in {**selection_metrics, **selection_by_staleness(out.selected, b.mask, s.staleness[i])}.items():
        s.add(k, v)
    loss = out.loss
    if cfg.algo.kl_coef > 0 and s.ref_lp is not None:
        kl = compute_approx_kl(lp, s.ref_lp[i], kl_estimator=cfg.algo.kl_estimator)
        loss = loss + cfg.algo.kl_coef * aggregate(kl, b.mask, lc.agg, ctx.normalizer, setup.world_size)
    if with_bonus:
        bonus = entropy_bonus(ent, b.mask, s.bonus_coef, lc.agg, ctx.normalizer, setup.world_size)
        loss = loss + bonus
        s.add("loss/entropy_bonus", -bonus.item())
    # the normaliser already spans the whole mini-batch: no extra division by accumulation steps
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()
    s.add("loss/policy", out.loss.item())
    for k, v in out.metrics.items():
        s.add(f"loss/{k}" if not k.startswith("cov_") else f"cov/{k[4:]}", v)


def _all_reduce_sum(device: torch.device, world_size: int, *values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def _generator(setup: RankSetup, step: int, update: int, micro: int) -> torch.Generator:
    """The objective's random draws (Clip-Cov's choice) for one micro-batch: micro_batch scope, a different draw
    per rank; global scope, all ranks draw the same (they must agree). `update` counts the step's optimizer steps
    over its passes (epoch x mini-batches + mini-batch), so a later pass draws afresh and the first draws as ever."""
    rank = 0 if setup.cfg.loss.scope == "global" else setup.rank
    seed = (setup.cfg.train.seed * 1_000_003 + step * 10_007 + update * 101 + micro * 7 + rank * 1_009) % 2**63
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ 4. the step's result


def step_result(s: StepState, *, world_size: int, skipped: int, lr: float, seconds: float) -> dict[str, float]:
    """The step's metrics on this rank, reduced over its micro-batches, with what the actor measured around them
    (`skipped` optimizer steps, the learning rate, the step's seconds)."""
    result = reduce_micro_batches(s.metrics, len(s.minis) * s.epochs, world_size)
    result["loss/entropy_coef"] = s.bonus_coef
    result["train/skipped_steps"] = float(skipped)
    result["train/lr"] = float(lr)
    result["time/train_actor"] = seconds
    result["train/tokens"] = float(sum(float(b.mask.sum()) for b in s.batches))
    # the micro-batches this rank ran (stand-ins too: they cost a forward and a backward) and the tokens of the real
    # ones (prompt + response, padding not counted)
    result["train/micro_batches"] = float(len(s.batches))
    sizes = [float(b.attention_mask.sum()) for b in s.batches if b.mask.any()] or [0.0]
    result["train/micro_batch_tokens_mean"] = sum(sizes) / len(sizes)
    result["train/micro_batch_tokens_max"] = max(sizes)
    return result
