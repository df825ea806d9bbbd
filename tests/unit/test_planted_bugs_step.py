"""The policy's RL step on one rank (PolicyActor.train_step and actors/train_phases.py), run through the harness of
tests/unit/policy_harness.py on the tiny model: what a user pays for when the step's bookkeeping goes wrong.

Every expected loss is computed here from the samples alone: in the first forward of a step the weights have not
moved, so PPO's ratio is exactly 1 and each token's loss is -A; with the optimizer's rate at 0 (the harness's
`lr=0.0`) every pass of the step sees those weights again.
"""

from __future__ import annotations

import pytest
import torch

from entropy_openrlhf.actors import train_phases
from entropy_openrlhf.actors.step_data import TrainSample
from tests.unit.policy_harness import (
    load_model,
    make_actor,
    make_samples,
    model_log_probs,
    one_thread,
    step_config,
    weights,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def spy(monkeypatch, name: str, record: callable) -> list:
    """Wrap train_phases.<name> so that every call is recorded (by `record(*args, **kwargs)`) and then run."""
    calls, real = [], getattr(train_phases, name)

    def wrapper(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(train_phases, name, wrapper)
    return calls


def minus_mean_advantage(samples: list[TrainSample], agg: str, norm_len: float = 0.0) -> float:
    """The loss at ratio 1 (each valid token's loss -A) under `agg`, over `samples` as one mini-batch, written out
    per response; a response whose every token is masked counts in no denominator."""
    rows = []
    for s in samples:
        keep = s.response_mask if s.response_mask is not None else [1] * len(s.response_ids)
        rows.append((s.advantage, sum(keep)))
    live = [(a, n) for a, n in rows if n > 0]
    if agg == "token_mean":
        return -sum(a * n for a, n in live) / sum(n for _, n in live)
    per_seq = {"seq_mean_token_mean": lambda a, n: -a, "seq_mean_token_sum": lambda a, n: -a * n,
               "seq_mean_token_sum_norm": lambda a, n: -a * n / norm_len}[agg]  # fmt: skip
    return sum(per_seq(a, n) for a, n in live) / len(live)


# --------------------------------------------------------------------------------- optimizer steps


def test_every_mini_batch_of_every_pass_ends_in_an_applied_optimizer_step(tiny):
    """Catches a step whose gradient-accumulation boundary is never reached: DeepSpeed then never applies the
    optimizer, every step is counted as skipped and the weights never move."""
    cfg = step_config("--train.ppo_epochs", "2", "--actor.lr", "1e-3")  # 2 mini-batches of 2 micro-batches
    model = load_model(tiny)
    actor = make_actor(cfg, model)
    before = weights(model)
    metrics = actor.train_step(make_samples(model), 0)
    assert actor.engine.micro_steps == 2 * 4  # every micro-batch of both passes ran its backward and step
    assert actor.engine.applied_steps == 2 * 2 and metrics["train/skipped_steps"] == 0.0
    assert max(float((p - before[n]).abs().max()) for n, p in weights(model).items()) > 1e-4


# --------------------------------------------------------------------------------- the loss and its normaliser


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_a_fully_masked_response_counts_in_no_normaliser(tiny, agg):
    """Catches a sequence count that includes responses whose every token is masked (a tool's whole output,
    --loss.mask_truncated): the per-sequence means would be divided by sequences that hold no loss."""
    cfg = step_config("--loss.agg", agg, mini=1)
    model = load_model(tiny)
    samples = make_samples(model, seed=3)
    samples[1].response_mask = [0] * len(samples[1].response_ids)
    samples[6].response_mask = [1, 0] + [1] * (len(samples[6].response_ids) - 2)
    metrics = make_actor(cfg, model).train_step(samples, 0)
    assert metrics["loss/policy"] == pytest.approx(minus_mean_advantage(samples, agg), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("norm_len", [0, 50])
def test_dr_grpo_s_constant_length_defaults_to_the_generation_limit(tiny, norm_len):
    """Catches `seq_mean_token_sum_norm` left without its length when --loss.agg_norm_len is 0 (the default): the
    step must divide each response's token sum by --rollout.max_new_tokens, not raise."""
    cfg = step_config("--loss.agg", "seq_mean_token_sum_norm", "--loss.agg_norm_len", str(norm_len),
                      "--rollout.max_new_tokens", "40", mini=1)  # fmt: skip
    model = load_model(tiny)
    samples = make_samples(model, seed=4)
    metrics = make_actor(cfg, model).train_step(samples, 0)
    want = minus_mean_advantage(samples, "seq_mean_token_sum_norm", norm_len=norm_len or 40)
    assert metrics["loss/policy"] == pytest.approx(want, rel=1e-6)


def test_the_step_loss_is_the_mean_over_the_optimizer_steps_of_every_pass(tiny):
    """Catches loss/policy divided by the mini-batches alone when --train.ppo_epochs > 1: with the weights held
    still, each of the 2 x 2 optimizer steps has the same loss as its mini-batch in one pass, and so has their mean;
    dividing the sum by 2 mini-batches reports twice that."""
    model = load_model(tiny)
    samples = make_samples(model, seed=5)
    want = sum(minus_mean_advantage(samples[m * 4 : m * 4 + 4], "token_mean") for m in range(2)) / 2
    for epochs in (1, 2):
        actor = make_actor(step_config("--train.ppo_epochs", str(epochs)), model, lr=0.0)
        metrics = actor.train_step(samples, 0)
        assert actor.engine.applied_steps == 2 * epochs
        assert metrics["loss/policy"] == pytest.approx(want, rel=1e-6)


# --------------------------------------------------------------------------------- random draws


@pytest.mark.parametrize("scope", ["micro_batch", "global"])
def test_each_optimizer_step_of_each_pass_draws_afresh(tiny, monkeypatch, scope):
    """Catches a later --train.ppo_epochs pass that reuses the first pass's random draws (Clip-Cov's choice of
    tokens): the generator handed to the selection must start from a different state at every optimizer step of
    the step, passes included, and the same at the same point of a repeated step."""
    if scope == "micro_batch":  # each micro-batch's objective selects with the generator its context carries
        calls = spy(monkeypatch, "run_objective", lambda name, params, lc, ctx, *a, **k: ctx.generator.get_state())
    else:  # the selection over the whole mini-batch, before its micro-batches
        calls = spy(monkeypatch, "select_tokens", lambda name, params, lc, batch, ctx: ctx.generator.get_state())

    def draws() -> list[torch.Tensor]:
        calls.clear()
        cfg = step_config("--train.ppo_epochs", "2", "--loss.scope", scope, loss="clip_cov")
        cfg.loss.clip_cov.lb, cfg.loss.clip_cov.ub = -1e9, 1e9  # every token a candidate: the draw decides
        model = load_model(tiny)
        make_actor(cfg, model).train_step(make_samples(model, seed=6), 0)
        return list(calls)

    first = draws()
    # micro_batch scope: one selection per micro-batch (2 x 2 per pass); global: one per mini-batch (2 per pass)
    assert len(first) == (8 if scope == "micro_batch" else 4)
    assert len({bytes(s.numpy()) for s in first}) == len(first)
    assert all(torch.equal(a, b) for a, b in zip(first, draws()))


# --------------------------------------------------------------------------------- pi_old and its metrics


def test_vllm_kl_is_the_rollout_s_log_probs_minus_the_trainer_s(tiny):
    """Catches rollout/vllm_kl with its sign flipped: it is the mean over valid tokens of log pi_rollout -
    log pi_old (docs/guides/metrics.md), here with rollout log-probs 0.25 nats above the model's."""
    model = load_model(tiny)
    samples = make_samples(model, seed=7)
    gaps = []
    for s in samples:
        own = model_log_probs(model, s.prompt_ids, s.response_ids)
        s.rollout_log_probs = [x + 0.25 + 0.05 * ((i % 3) - 1) for i, x in enumerate(own)]
        gaps += [r - x for r, x in zip(s.rollout_log_probs, own)]
    cfg = step_config(mini=1, micro=8)  # one micro-batch: its mean is the step's
    metrics = make_actor(cfg, model).train_step(samples, 0)
    assert metrics["rollout/vllm_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
    assert metrics["rollout/vllm_kl"] > 0.2


def test_a_later_pass_trains_against_the_first_pass_s_pi_old_and_weights(tiny, monkeypatch):
    """Catches a later --train.ppo_epochs pass whose first mini-batch takes its pi_old (and off-policy weights)
    from its own training forward, after the weights have moved: every pass must see the pi_old of the weights
    the step started from."""

    def pi_old_and_weights(name, params, lc, ctx, lp, old, adv, mask, **kw):
        return old.clone(), kw["is_weights"].clone()

    calls = spy(monkeypatch, "run_objective", pi_old_and_weights)
    cfg = step_config("--train.ppo_epochs", "2", "--actor.lr", "1e-2", "--offpolicy.preset", "token_tis")
    model = load_model(tiny)
    samples = make_samples(model, seed=8)
    own = [x for s in samples for x in model_log_probs(model, s.prompt_ids, s.response_ids)]
    actor = make_actor(cfg, model)
    actor.train_step(samples, 0)
    assert actor.engine.applied_steps == 4 and len(calls) == 8
    masks = [b.mask.bool() for b in train_phases.prepare_step(actor.setup, actor.engine, samples, 0, 1.0, None).batches]
    old = [x for (o, _), m in zip(calls[:4], masks) for x in o[m].tolist()]
    assert old == pytest.approx(own, abs=1e-5)  # the first pass: the starting weights' log-probs
    for k in range(4):  # the second pass: the same pi_old and weights, micro-batch by micro-batch
        assert torch.equal(calls[4 + k][0], calls[k][0]) and torch.equal(calls[4 + k][1], calls[k][1]), k
    # the weights moved in between: a fresh forward would have given other numbers
    moved = [x for s in samples[:4] for x in model_log_probs(model, s.prompt_ids, s.response_ids)]
    assert max(abs(a - b) for a, b in zip(moved, own[: len(moved)])) > 1e-3


def test_a_global_selection_has_its_old_pass_before_the_first_training_forward(tiny, monkeypatch):
    """Catches a global selection (--loss.scope global) that lets the first mini-batch take its old log-probs from
    its training forward: the selection over the whole mini-batch runs before that forward, so the separate no-grad
    pass must cover every micro-batch, and the selection sees the starting weights' log-probs."""
    pooled = spy(monkeypatch, "pooled_selection", lambda batches, *a, **k: [b.log_probs.clone() for b in batches])
    cfg = step_config("--loss.scope", "global", loss="kl_cov")
    model = load_model(tiny)
    samples = make_samples(model, seed=9)
    own = [x for s in samples[:4] for x in model_log_probs(model, s.prompt_ids, s.response_ids)]
    actor = make_actor(cfg, model)
    metrics = actor.train_step(samples, 0)
    assert metrics["train/old_pass_micro_batches"] == 4.0
    # the old pass (4) and the second mini-batch's selection (2); the first mini-batch's selection reuses the pass
    assert actor.engine.forwards["no_grad"] == 4 + 2
    masks = [b.mask.bool() for b in train_phases.prepare_step(actor.setup, actor.engine, samples, 0, 1.0, None).batches]
    first = [x for lp, m in zip(pooled[0], masks[:2]) for x in lp[m].tolist()]
    assert first == pytest.approx(own, abs=1e-5)


def test_under_bypass_a_global_selection_reads_the_current_weights_not_the_rollout(tiny, monkeypatch):
    """Catches a global selection under --offpolicy.bypass that takes pi_old (the rollout's log-probs) for the
    current weights' at the first optimizer step: there is no old pass to reuse, so it must run its own forward."""
    pooled = spy(monkeypatch, "pooled_selection", lambda batches, *a, **k: [b.log_probs.clone() for b in batches])
    cfg = step_config("--loss.scope", "global", "--offpolicy.bypass", "true", loss="kl_cov")
    model = load_model(tiny)
    samples = make_samples(model, seed=10, noise=0.5)
    own = [x for s in samples[:4] for x in model_log_probs(model, s.prompt_ids, s.response_ids)]
    actor = make_actor(cfg, model)
    metrics = actor.train_step(samples, 0)
    assert metrics["train/old_pass_micro_batches"] == 0.0
    masks = [b.mask.bool() for b in train_phases.prepare_step(actor.setup, actor.engine, samples, 0, 1.0, None).batches]
    first = [x for lp, m in zip(pooled[0], masks[:2]) for x in lp[m].tolist()]
    rollout = [x for s in samples[:4] for x in s.rollout_log_probs]
    assert first == pytest.approx(own, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(first, rollout)) > 0.1
