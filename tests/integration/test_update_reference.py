"""The policy actor's update, pinned to a reference computed here from the plain loss functions.

One RL step of the real DeepSpeed policy group (ZeRO-2, fp32, gloo) on a fixed batch of a tiny model: 16 responses
in 2 optimizer mini-batches, micro-batches of 2 (so gradients accumulate over several micro-batches per optimizer
step), truncated importance weights on. The same step is computed in this process with transformers, the public
loss functions of `entropy_openrlhf.algorithms.losses`, torch's gradient clipping and AdamW, sharded across ranks
the way `PolicyGroup.train_step` documents it. The weights after the step must agree.

AdamW's first steps move each weight by about lr * sign(gradient), which would hide a wrong gradient size; with
`--actor.adam_eps 1` (larger than any gradient here) the update is nearly proportional to the gradient, so the
comparison checks the gradients themselves. The tolerance is a small fraction of the update, and a reference
without the covariance selection misses it by far (checked too), so the test can fail.
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.lora import apply_lora, named_weights
from entropy_openrlhf.actors.policy import PolicyGroup, TrainSample
from entropy_openrlhf.algorithms.losses import (
    cispo_loss,
    clip_cov_loss,
    gspo_loss,
    high_entropy_loss,
    high_entropy_select,
    kl_cov_loss,
    kl_cov_select,
)
from entropy_openrlhf.algorithms.selection import MicroBatch, global_selection
from entropy_openrlhf.config import Config, from_args

pytestmark = pytest.mark.integration

SEED, STEP, N, MINI, MICRO = 3, 0, 16, 2, 2
RATIO = 0.1  # of each selection's valid tokens
IS_CAP = 1.5


def model_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response token | everything before it), one sequence at a time: no padding, no shared code."""
    return model_log_probs_and_entropy(model, prompt, response)[0]


def model_log_probs_and_entropy(model, prompt: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same log-probs, and the entropy of the whole next-token distribution at each response token (detached)."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    entropy = -(logp.exp() * logp).sum(-1).detach()
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0], entropy


def grid(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, L) values and their mask, rows in order (the row-major order of the actor's grid)."""
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        values[i, : len(r)] = r
        mask[i, : len(r)] = 1.0
    return values, mask


def make_batch(model_path: str) -> tuple[list[TrainSample], list[torch.Tensor]]:
    """16 responses with advantages, and rollout log-probs off the model's by up to +-1 nat, so that some
    importance weights exp(old - rollout) pass the cap. Returns the samples and the model's own log-probs."""
    rng = random.Random(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    samples, old = [], []
    with torch.no_grad():
        for i in range(N):
            prompt = [1, 5 + i // 4, 6, 7 + i // 4 % 3]  # groups of 4 responses share a prompt, as in GRPO
            response = [rng.randrange(3, 300) for _ in range(rng.randint(4, 12))]
            lp = model_log_probs(model, prompt, response)
            rollout = [float(x) + rng.uniform(-1.0, 1.0) for x in lp]
            samples.append(TrainSample(prompt, response, rng.gauss(0.0, 1.0), rollout))
            old.append(lp)
    return samples, old


TOP_FRAC = 0.3  # high_entropy's share (not a divisor of the micro-batch sizes, so its rounding shows)


def config(
    loss: str, scope: str, workers: int, shared_prefix: str, within: str = "", lora: int = 0, epochs: int = 1
) -> Config:
    # LoRA cases: the adapters on every linear layer, under ZeRO-3 when two ranks share them
    lora_flags = ["--actor.lora_rank", str(lora), "--actor.lora_alpha", str(2 * lora),
                  "--actor.zero_stage", "3" if workers > 1 else "2"] if lora else []  # fmt: skip
    cfg = from_args(
        [
            "--preset", "smoke",
            "--train.seed", str(SEED),
            "--train.mini_batches", str(MINI),
            "--actor.num_workers", str(workers),
            "--actor.micro_batch_size", str(MICRO),
            "--actor.lr", "0.05",
            "--actor.adam_eps", "1.0",
            "--actor.grad_clip", "1.0",
            "--loss.scope", scope,
            "--offpolicy.preset", "token_tis",
            "--offpolicy.is_max", str(IS_CAP),
            "--train.shared_prefix", shared_prefix,
            "--train.ppo_epochs", str(epochs),
            *lora_flags,
        ],
        {"loss.type": loss, **({"loss.clip_low": 1.0, "loss.clip_high": 1.0} if loss == "clip_cov" else {})},
    )  # fmt: skip
    cfg.loss.kl_cov.ratio = cfg.loss.clip_cov.ratio = RATIO
    cfg.loss.clip_cov.lb, cfg.loss.clip_cov.ub = -1e9, 1e9  # a tiny random model's covariances are tiny
    cfg.loss.high_entropy.top_frac = TOP_FRAC
    cfg.loss.kl_cov.within = within
    # CISPO and GSPO at clip widths that act on a step this size (their defaults would clip nearly all of GSPO)
    cfg.loss.cispo.clip_low, cfg.loss.cispo.clip_high = 0.05, 0.05
    cfg.loss.gspo.clip_low, cfg.loss.gspo.clip_high = 0.02, 0.02
    return cfg


def actor_generator(cfg: Config, mini: int, micro: int, rank: int) -> torch.Generator:
    """The seeds the policy actor draws Clip-Cov's choice with (per micro-batch and rank; rank 0 in global
    scope, where every rank must draw the same)."""
    rank = 0 if cfg.loss.scope == "global" else rank
    seed = (cfg.train.seed * 1_000_003 + STEP * 10_007 + mini * 101 + micro * 7 + rank * 1_009) % 2**63
    return torch.Generator().manual_seed(seed)


def reference_step(model_path, cfg, samples, old_rows, workers, select=True):
    """One RL step outside the actor. Returns (state dict after it, selected fraction per micro-batch,
    importance weights per sample). `select=False` computes a variant that must miss: the objective with nothing
    selected, or for CISPO and GSPO (which select nothing) the other aggregation (per token vs per sequence)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if cfg.actor.lora_rank:  # the actor's adapters: apply_lora draws them from the run's seed
        model = apply_lora(model, cfg)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.actor.lr, betas=tuple(cfg.actor.adam_betas),
        eps=cfg.actor.adam_eps, weight_decay=cfg.actor.weight_decay,
    )  # fmt: skip
    lc = cfg.loss
    cap = cfg.off_policy.is_max
    weights = [torch.exp(o - torch.tensor(s.rollout_log_probs)).clamp(max=cap) for s, o in zip(samples, old_rows)]
    if cfg.off_policy.bypass:  # pi_old is the rollout's (old_rows): nothing to reweight
        weights = [torch.ones(len(s.response_ids)) for s in samples]
    per_mini, fracs = N // MINI, []
    per_rank = per_mini // workers
    # --train.ppo_epochs: the mini-batches again, against the same old log-probs and importance weights
    for epoch, mini in ((e, m) for e in range(cfg.train.ppo_epochs) for m in range(MINI)):
        draw = epoch * MINI + mini  # the actor's count of the step's optimizer steps, its seeds' input
        # PolicyGroup.train_step: rank r takes samples [r * per_rank, (r + 1) * per_rank) of each mini-batch, and
        # cuts them into micro-batches of MICRO
        ranks = [
            [list(range(mini * per_mini + r * per_rank + j, mini * per_mini + r * per_rank + min(j + MICRO, per_rank)))
             for j in range(0, per_rank, MICRO)]
            for r in range(workers)
        ]  # fmt: skip
        normalizer = sum(len(samples[i].response_ids) for i in range(mini * per_mini, (mini + 1) * per_mini))
        sequences = per_mini  # every response has tokens
        tensors = {}  # (rank, micro) -> (old, adv, mask, is weights)
        for r, micros in enumerate(ranks):
            for j, idx in enumerate(micros):
                old, mask = grid([old_rows[i] for i in idx])
                adv = mask * torch.tensor([[samples[i].advantage] for i in idx])
                tensors[r, j] = (old, adv, mask, grid([weights[i] for i in idx])[0])
        selections, cov_means, selected_total = {}, None, None
        if select and lc.scope == "global" and lc.type == "high_entropy":
            # the top entropies among every valid token of the mini-batch on all ranks, the weights not yet moved
            with torch.no_grad():
                ent = {key: grid([model_log_probs_and_entropy(model, samples[i].prompt_ids, samples[i].response_ids)[1]
                                  for i in ranks[key[0]][key[1]]])[0] for key in tensors}  # fmt: skip
            keys = sorted(tensors)
            pooled = torch.cat([ent[k][tensors[k][2].bool()] for k in keys])[None]
            chosen = high_entropy_select(pooled, torch.ones_like(pooled), top_frac=TOP_FRAC)[0]
            start = 0
            for k in keys:
                valid = tensors[k][2].bool()
                sel = torch.zeros_like(valid)
                sel[valid] = chosen[start : start + int(valid.sum())]
                selections[k], start = sel, start + int(valid.sum())
            selected_total = int(chosen.sum())
        elif select and lc.scope == "global":
            with torch.no_grad():
                current = {
                    key: grid([model_log_probs(model, samples[i].prompt_ids, samples[i].response_ids) for i in idx])[0]
                    for key, idx in ((key, ranks[key[0]][key[1]]) for key in tensors)
                }
            keys = sorted(tensors)  # rank order, then micro-batch order: the order of the gathered tokens
            masks, cov_means = global_selection(
                [MicroBatch(current[k], tensors[k][0], tensors[k][1], tensors[k][2]) for k in keys],
                lc.type, ratio=RATIO, cov_lb=lc.clip_cov.lb, cov_ub=lc.clip_cov.ub, clip_low=lc.clip_low,
                clip_high=lc.clip_high, generator=actor_generator(cfg, draw, 0, 0),
            )  # fmt: skip
            selections = dict(zip(keys, masks))
        opt.zero_grad()
        for (r, j), (old, adv, mask, w) in tensors.items():
            idx = ranks[r][j]
            pairs = [model_log_probs_and_entropy(model, samples[i].prompt_ids, samples[i].response_ids) for i in idx]
            lp, ent = grid([p[0] for p in pairs])[0], grid([p[1] for p in pairs])[0]
            common = dict(agg="token_mean", normalizer=normalizer, dp_size=1, is_weights=w)
            if not select:  # the same objective with nothing selected: what a broken selection would give
                common["selected"] = torch.zeros_like(mask, dtype=torch.bool)
            elif lc.scope == "global":
                common.update(selected=selections[r, j], cov_means=cov_means)
            elif lc.kl_cov.within == "high_entropy":  # KL-Cov's choice among the micro-batch's high-entropy tokens
                forking = high_entropy_select(ent, mask, top_frac=TOP_FRAC)
                common["selected"] = kl_cov_select(lp, adv, mask, ratio=RATIO, candidates=forking)
            if lc.type == "high_entropy":
                if lc.scope == "global":  # the mean over every selected token of the mini-batch, all ranks
                    norm = selected_total if select else normalizer
                    out = high_entropy_loss(
                        lp, old, adv, mask, ent, top_frac=TOP_FRAC, clip_low=lc.clip_low, clip_high=lc.clip_high,
                        selected=common.get("selected"), normalizer=norm, is_weights=w,
                    )  # fmt: skip
                else:
                    # the authors' rule: each micro-batch's mean over its own selected tokens, averaged over the
                    # mini-batch's micro-batches and (by the data-parallel gradient average) over the ranks
                    chosen = high_entropy_select(ent, mask, top_frac=TOP_FRAC)
                    norm = max(int(chosen.sum()), 1) * len(ranks[r]) * workers
                    out = high_entropy_loss(
                        lp, old, adv, mask, ent, top_frac=TOP_FRAC, clip_low=lc.clip_low, clip_high=lc.clip_high,
                        selected=chosen if select else torch.zeros_like(chosen), normalizer=norm, is_weights=w,
                    )  # fmt: skip
            elif lc.type == "cispo":
                # the variant averages per sequence: a uniform rescale would vanish in the gradient clip, a
                # re-weighting of the sequences does not
                out = cispo_loss(
                    lp, old, adv, mask, clip_low=lc.cispo.clip_low, clip_high=lc.cispo.clip_high,
                    agg="token_mean" if select else "seq_mean_token_mean",
                    normalizer=normalizer if select else sequences, is_weights=w,
                )  # fmt: skip
            elif lc.type == "gspo":
                out = gspo_loss(
                    lp, old, adv, mask, clip_low=lc.gspo.clip_low, clip_high=lc.gspo.clip_high,
                    normalizer=sequences if select else normalizer, is_weights=w,
                )  # fmt: skip
            elif lc.type == "kl_cov":
                out = kl_cov_loss(lp, old, adv, mask, ratio=RATIO, coef=lc.kl_cov.coef, **common)
            else:
                out = clip_cov_loss(
                    lp, old, adv, mask, ratio=RATIO, cov_lb=lc.clip_cov.lb, cov_ub=lc.clip_cov.ub,
                    clip_low=lc.clip_low, clip_high=lc.clip_high, generator=actor_generator(cfg, draw, j, r), **common,
                )  # fmt: skip
            out.loss.backward()
            fracs.append(float(out.selected.sum()) / float(mask.sum()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip)
        opt.step()
    # the weights the actor exports: under LoRA each base weight with its adapter's update (W + alpha/r B A)
    return {k: v.detach().clone() for k, v in named_weights(model, lambda params: nullcontext())}, fracs, weights


def actor_step(cfg: Config, model_path: str, samples: list[TrainSample]) -> tuple[dict, dict, dict]:
    """(the initial weights, the step's metrics, the weights rank 0 exports after it) of one step of a real
    PolicyGroup on `samples`, its actors shut down whatever happens."""
    initial = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(model_path).state_dict().items()}
    group = PolicyGroup(cfg, model_path)
    try:
        metrics = group.train_step(samples, STEP)
        actor = group.call_all("export_weights")[0]
    finally:
        group.shutdown()
    return initial, metrics, actor


# Every registered objective, through the registry on the actor's side and the plain loss functions on the
# reference's: (loss, scope, ranks, shared_prefix, within, lora). The cases whose part of the step is only the actor's
# own code (an objective's loss and selection inside a micro-batch, one rank's packing) run on the real DeepSpeed
# group here in one case each kind of DeepSpeed step needs (one rank and two, both scopes, LoRA under ZeRO-2 and
# ZeRO-3); the others run the same actor code and the same checks behind tests/unit/policy_harness.py's stand-in for
# the DeepSpeed engine, in tests/unit/test_actor_step_reference.py.
DEEPSPEED_CASES = [
    ("kl_cov", "micro_batch", 1, "on", "", 0), ("kl_cov", "global", 2, "auto", "", 0),
    ("clip_cov", "global", 2, "on", "", 0), ("high_entropy", "global", 2, "off", "", 0),
    ("kl_cov", "micro_batch", 1, "auto", "", 8), ("clip_cov", "global", 2, "on", "", 8),
]  # fmt: skip
HARNESS_CASES = [
    ("clip_cov", "micro_batch", 1, "off", "", 0), ("high_entropy", "micro_batch", 2, "on", "", 0),
    ("cispo", "micro_batch", 1, "auto", "", 0), ("gspo", "micro_batch", 2, "on", "", 0),
    ("kl_cov", "micro_batch", 1, "off", "high_entropy", 0),
]  # fmt: skip
# --train.ppo_epochs 2: (loss, scope, ranks, shared_prefix)
DEEPSPEED_TWO_PASS_CASES = [("clip_cov", "global", 2, "on")]
HARNESS_TWO_PASS_CASES = [("kl_cov", "micro_batch", 1, "off")]


def check_one_step(model_path, cfg, loss, scope, workers, within, samples, old_rows, initial, metrics, actor) -> None:
    """The step the actor took (`initial` and `actor`: the weights before and after it, `metrics` its merged metrics)
    against the reference step on the same samples: the weights, the selected shares and the importance weights."""
    expected, fracs, weights = reference_step(model_path, cfg, samples, old_rows, workers)

    def deviation(state: dict) -> float:
        return max(float((actor[k].float() - state[k]).abs().max()) for k in actor)

    update = max(float((expected[k] - initial[k]).abs().max()) for k in actor)
    tolerance = 1e-3 * update
    assert update > 1e-3  # the step moved the weights
    case = f"{loss}/{scope}/{workers}/{cfg.train.shared_prefix}/{within}/lora{cfg.actor.lora_rank}"
    print(f"\n{case}: update {update:.3g}, deviation {deviation(expected):.3g}")
    assert deviation(expected) < tolerance, (deviation(expected), update)
    unselected, _, _ = reference_step(model_path, cfg, samples, old_rows, workers, select=False)
    print(f"without selection: deviation {deviation(unselected):.3g}")
    assert deviation(unselected) > 20 * tolerance  # the selection matters at this tolerance

    if loss in ("cispo", "gspo"):
        return  # they select nothing; the importance weights are checked in the cases above
    if loss == "high_entropy":
        # per micro-batch at least k = int(0.3 n + 0.9999) of its n valid tokens; more when entropies tie at the
        # threshold (a tiny random model's are nearly uniform), and the actor's count is the reference's
        if scope == "micro_batch":
            sizes = [sum(len(s.response_ids) for s in samples[i : i + MICRO]) for i in range(0, N, MICRO)]
            assert all(f >= int(TOP_FRAC * n + 0.9999) / n for f, n in zip(fracs, sizes))
            assert metrics["loss/entropy_selected_frac"] == pytest.approx(sum(fracs) / len(fracs), abs=1e-9)
        return
    if within:
        assert 0 <= metrics["select/overlap_cov_entropy"] <= 1
        assert metrics["select/within_frac"] == pytest.approx(0.3, abs=0.1)
    # the selected share: max(1, floor(0.1 * valid tokens)) per selection, averaged as the actor reports it
    key = "loss/kl_cov_frac" if loss == "kl_cov" else "loss/clip_cov_frac"
    if scope == "micro_batch":
        counts = [sum(len(s.response_ids) for s in samples[i : i + MICRO]) for i in range(0, N, MICRO)]
        hand = [max(1, math.floor(RATIO * n)) / n for n in counts]
        assert fracs == pytest.approx(hand, abs=1e-12)
        assert metrics[key] == pytest.approx(sum(hand) / len(hand), abs=1e-9)
    else:
        for mini in range(MINI):
            tokens = sum(len(s.response_ids) for s in samples[mini * N // MINI : (mini + 1) * N // MINI])
            per_mini = fracs[mini * len(fracs) // MINI : (mini + 1) * len(fracs) // MINI]
            sizes = [sum(len(s.response_ids) for s in samples[i : i + MICRO]) for i in range(
                mini * N // MINI, (mini + 1) * N // MINI, MICRO)]  # fmt: skip
            chosen = round(sum(f * n for f, n in zip(per_mini, sizes)))
            assert chosen == max(1, math.floor(RATIO * tokens))

    # truncated importance sampling: the weights exp(old - rollout) capped at is_cap, as the actor reports them
    all_w = torch.cat(weights)
    assert float(all_w.max()) == pytest.approx(IS_CAP) and 0 < float((all_w >= IS_CAP).float().mean()) < 0.5
    n_mini_tokens = [sum(len(s.response_ids) for s in samples[i : i + MICRO]) for i in range(0, N, MICRO)]
    per_micro_mean = [float(torch.cat(weights[i : i + MICRO]).mean()) for i in range(0, N, MICRO)]
    assert len(per_micro_mean) == len(n_mini_tokens)
    assert metrics["offpolicy/weight_mean"] == pytest.approx(sum(per_micro_mean) / len(per_micro_mean), abs=1e-5)
    assert metrics["offpolicy/weight_max"] == pytest.approx(IS_CAP)  # reduced by max over micro-batches


@pytest.mark.parametrize("loss, scope, workers, shared_prefix, within, lora", DEEPSPEED_CASES)
def test_one_actor_step_equals_the_reference_step(
    ray_cluster, tiny_model, loss, scope, workers, shared_prefix, within, lora
):
    """`shared_prefix` on/auto: the actor packs each micro-batch's pair of responses behind their one prompt; the
    reference never packs. Every registered objective is pinned to the reference through the registry on the actor's
    side and the plain loss functions on the reference's (DEEPSPEED_CASES here, HARNESS_CASES behind the harness).
    `lora`: the adapters train (ZeRO-3 over two ranks), the base stays, and the exported weights are the base with
    the adapters' update merged."""
    cfg = config(loss, scope, workers, shared_prefix, within, lora)
    samples, old_rows = make_batch(tiny_model)
    initial, metrics, actor = actor_step(cfg, tiny_model, samples)
    check_one_step(tiny_model, cfg, loss, scope, workers, within, samples, old_rows, initial, metrics, actor)


def check_two_passes(model_path, cfg, loss, scope, workers, shared_prefix, samples, old_rows, initial, metrics, actor):
    """Two passes' step against the reference of two passes, which one pass misses by far."""
    expected, _, _ = reference_step(model_path, cfg, samples, old_rows, workers)
    one_pass, _, _ = reference_step(model_path, config(loss, scope, workers, shared_prefix), samples, old_rows, workers)

    def deviation(state: dict) -> float:
        return max(float((actor[k].float() - state[k]).abs().max()) for k in actor)

    update = max(float((expected[k] - initial[k]).abs().max()) for k in actor)
    print(f"\n{loss}/{scope}/2 passes: update {update:.3g}, deviation {deviation(expected):.3g}, "
          f"one pass {deviation(one_pass):.3g}")  # fmt: skip
    assert update > 1e-3
    assert deviation(expected) < 1e-3 * update
    assert deviation(one_pass) > 20e-3 * update
    assert metrics["train/skipped_steps"] == 0


@pytest.mark.parametrize("loss, scope, workers, shared_prefix", DEEPSPEED_TWO_PASS_CASES)
def test_two_passes_over_the_batch_equal_the_reference_steps(
    ray_cluster, tiny_model, loss, scope, workers, shared_prefix
):
    """`--train.ppo_epochs 2`: each mini-batch trains twice, the second pass against the same old log-probs and
    importance weights, with its own Clip-Cov draws and (global scope) a selection from the weights as they are
    then. A reference of one pass misses by far. (KL-Cov on one rank: the harness, HARNESS_TWO_PASS_CASES.)"""
    cfg = config(loss, scope, workers, shared_prefix, epochs=2)
    samples, old_rows = make_batch(tiny_model)
    initial, metrics, actor = actor_step(cfg, tiny_model, samples)
    check_two_passes(tiny_model, cfg, loss, scope, workers, shared_prefix, samples, old_rows, initial, metrics, actor)


def test_bypass_step_equals_the_reference_step_against_the_rollout_log_probs(ray_cluster, tiny_model):
    """--offpolicy.bypass: the actor runs no old-log-prob pass and its PPO ratio is pi_theta / pi_rollout. The same
    KL-Cov step with the rollout's log-probs as pi_old (and no weights) is the reference; with the model's own
    log-probs as pi_old it misses."""
    cfg = config("kl_cov", "micro_batch", 1, "on")
    cfg.offpolicy = type(cfg.offpolicy)(bypass=True)  # in place of config()'s token TIS: bypass admits none
    samples, old_rows = make_batch(tiny_model)
    rollout_rows = [torch.tensor(s.rollout_log_probs) for s in samples]
    initial, metrics, actor = actor_step(cfg, tiny_model, samples)
    assert metrics["train/old_pass_micro_batches"] == 0
    expected, _, _ = reference_step(tiny_model, cfg, samples, rollout_rows, 1)
    update = max(float((expected[k] - initial[k]).abs().max()) for k in actor)
    deviation = max(float((actor[k].float() - expected[k]).abs().max()) for k in actor)
    print(f"\nbypass: update {update:.3g}, deviation {deviation:.3g}")
    assert update > 1e-3 and deviation < 1e-3 * update
    recomputed, _, _ = reference_step(tiny_model, cfg, samples, old_rows, 1)
    assert max(float((actor[k].float() - recomputed[k]).abs().max()) for k in actor) > 20e-3 * update
