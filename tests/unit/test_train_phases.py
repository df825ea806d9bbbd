"""A step's preparation on a policy rank (actors/train_phases.py::prepare_step): the loss mask each micro-batch
carries, narrowed by the samples' response masks, and the settings the loss context takes from the config."""

import math
from types import SimpleNamespace

import pytest
import torch

from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.actors.train_phases import RankSetup, prepare_step
from entropy_openrlhf.algorithms.selection import PooledSelection
from entropy_openrlhf.config import from_args

# a stand-in for the DeepSpeed engine: prepare_step reads only its device and its model's config
ENGINE = SimpleNamespace(device=torch.device("cpu"), module=SimpleNamespace(config=SimpleNamespace()))


def sample(response: list[int], mask: list[int] | None = None) -> TrainSample:
    return TrainSample([1, 2, 3], response, 1.0, [-0.5] * len(response), response_mask=mask)


def test_response_masks_narrow_the_loss_mask_of_their_micro_batch():
    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "1",
                     "--actor.micro_batch_size", "4", "--train.shared_prefix", "off"])  # fmt: skip
    samples = [sample([7, 8, 9], [1, 0, 1]), sample([7, 8]), sample([5, 6, 7, 8], [0, 0, 0, 0]), sample([4])]
    s = prepare_step(RankSetup(cfg, 0, 1, pad_id=0), ENGINE, samples, step=0, strength_scale=1.0, entropy_coef=None)
    (mask,) = [b.mask for b in s.batches]
    # each row's response tokens on the shifted grid (prompt of 3: positions 2, 3, ...), the masked ones removed
    want = torch.zeros(4, mask.shape[1])
    want[0, [2, 4]] = 1
    want[1, [2, 3]] = 1
    want[3, 2] = 1
    assert torch.equal(mask, want)


def test_without_response_masks_every_response_token_counts():
    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "2", "--train.mini_batches", "1",
                     "--train.shared_prefix", "off"])  # fmt: skip
    s = prepare_step(RankSetup(cfg, 0, 1, 0), ENGINE, [sample([7, 8, 9]), sample([7])], 0, 1.0, None)
    assert s.batches[0].mask.sum(-1).tolist() == [3.0, 1.0]


def test_a_global_selection_in_a_later_pass_reads_the_weights_as_they_are_then(monkeypatch):
    """`--train.ppo_epochs`: the first mini-batch of the first pass selects on the old pass's log-probs (the weights
    have not moved); every later optimizer step, the first mini-batch of a later pass included, on a fresh forward."""
    from entropy_openrlhf.actors import train_phases
    from entropy_openrlhf.algorithms.objectives import LossContext

    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "2",
                     "--actor.micro_batch_size", "2", "--train.shared_prefix", "off", "--train.ppo_epochs", "2",
                     "--loss.scope", "global"], {"loss.type": "kl_cov"})  # fmt: skip
    s = prepare_step(RankSetup(cfg, 0, 1, 0), ENGINE, [sample([7, 8]) for _ in range(4)], 0, 1.0, None)
    assert s.epochs == 2 and s.select_globally
    for i, b in enumerate(s.batches):
        s.old_lp[i], s.entropies[i] = torch.full(b.mask.shape, -1.0), torch.zeros(b.mask.shape)
    fresh = torch.full(s.batches[0].mask.shape, -2.0)
    monkeypatch.setattr(train_phases, "forward_log_probs", lambda *a, **k: (fresh, torch.zeros_like(fresh)))
    seen = []

    def pooled_selection(pooled, select, with_entropy, with_weights):
        seen.append(float(pooled[0].log_probs.flatten()[0]))
        return PooledSelection([None] * len(pooled), (0.0, 0.0), 0, {})

    monkeypatch.setattr(train_phases, "pooled_selection", pooled_selection)
    for epoch, mini in ((0, 0), (0, 1), (1, 0), (1, 1)):
        update = epoch * len(s.minis) + mini  # optimizer_step's count of the step's optimizer steps
        train_phases.select_globally(RankSetup(cfg, 0, 1, 0), ENGINE, s, update, s.minis[mini], LossContext())
    assert seen == [-1.0, -2.0, -2.0, -2.0]


def test_a_global_selection_never_chooses_a_token_the_old_pass_rejected():
    """select_globally hands the old pass's off-policy weights to the pooled selection: KL-Cov's top-K skips a
    response the band rejected (weight 0), the quota and the centring still counting its tokens."""
    from entropy_openrlhf.actors import train_phases
    from entropy_openrlhf.algorithms.objectives import LossContext

    cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", "1",
                     "--actor.micro_batch_size", "2", "--train.shared_prefix", "off", "--loss.scope", "global",
                     "--offpolicy.reject", "sequence", "--loss.kl_cov.ratio", "0.25"],
                    {"loss.type": "kl_cov"})  # fmt: skip
    samples = [TrainSample([1, 2, 3], [7, 8], a, [-0.5, -0.5]) for a in (2.0, -1.0, 1.0, -2.0)]
    s = prepare_step(RankSetup(cfg, 0, 1, 0), ENGINE, samples, 0, 1.0, None)
    # what the old pass leaves: log-probs that spread the covariances, and response 0 rejected
    s.old_lp = [torch.tensor([[0.0, 0.0, 2.5, 2.3], [0.0, 0.0, -0.2, -0.8]]),
                torch.tensor([[0.0, 0.0, -0.1, -0.9], [0.0, 0.0, -0.7, -0.3]])]  # fmt: skip
    assert all(torch.equal(b.mask, torch.tensor([[0.0, 0.0, 1, 1]] * 2)) for b in s.batches)
    s.entropies = [torch.zeros(2, 4), torch.zeros(2, 4)]
    s.is_weights = [b.mask.clone() for b in s.batches]
    s.is_weights[0][0] = 0.0
    masks, ctx = train_phases.select_globally(RankSetup(cfg, 0, 1, 0), ENGINE, s, 0, s.minis[0], LossContext())
    # independently: the covariance over all 8 valid tokens, then the top 2 outside response 0
    tokens = [(mb, row, pos) for mb in (0, 1) for row in (0, 1) for pos in (2, 3)]
    adv = {(0, 0): 2.0, (0, 1): -1.0, (1, 0): 1.0, (1, 1): -2.0}
    lp = {(mb, row, pos): float(s.old_lp[mb][row, pos]) for mb, row, pos in tokens}
    mean_a, mean_lp = sum(adv[t[:2]] for t in tokens) / 8, sum(lp.values()) / 8
    cov = {t: (adv[t[:2]] - mean_a) * (lp[t] - mean_lp) for t in tokens}
    assert max(cov, key=cov.get)[:2] == (0, 0)  # the rejected response holds the largest covariance
    want = set(sorted((t for t in tokens if t[:2] != (0, 0)), key=cov.get, reverse=True)[:2])
    got = {(mb, row, pos) for mb in (0, 1) for row, pos in masks[mb].nonzero().tolist()}
    assert got == want and ctx.selected_total == 2.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_reference_kl_term_adds_its_estimate_over_the_mini_batch_normaliser(monkeypatch, estimator, world_size):
    """`--algo.kl_coef`: the micro-batch's loss gains coef x sum over its valid tokens of the estimator of
    KL(pi_theta || pi_ref), divided by the mini-batch's token count and multiplied by the data-parallel size (the
    gradient averaging undone), as the policy loss is; its gradient is that of the formula written out here."""
    from entropy_openrlhf.actors import train_phases
    from entropy_openrlhf.algorithms.objectives import LossContext

    coef, tokens = 0.3, 10.0  # the mini-batch's count spans more than this micro-batch's 4 tokens
    ref = [[-0.9, -0.2], [-1.4, -0.6]]
    current = torch.tensor([[0.0, 0.0, -0.5, -0.1], [0.0, 0.0, -1.1, -0.9]])
    losses = {}
    for kl_coef in (0.0, coef):
        cfg = from_args(["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "2", "--train.mini_batches",
                         "1", "--train.shared_prefix", "off", "--algo.kl_coef", str(kl_coef), "--algo.kl_estimator",
                         estimator, "--ref.enabled", "true"])  # fmt: skip
        samples = [TrainSample([1, 2, 3], [7, 8], a, [-0.5, -0.5], ref_log_probs=r) for a, r in zip((1.0, -1.0), ref)]
        s = prepare_step(RankSetup(cfg, 0, world_size, 0), ENGINE, samples, 0, 1.0, None)
        s.old_lp[0] = current.clone()
        lp = current.clone().requires_grad_(True)
        monkeypatch.setattr(train_phases, "forward_log_probs", lambda *a, lp=lp, **k: (lp, torch.zeros_like(lp)))
        seen = []
        engine = SimpleNamespace(backward=lambda loss, scale_wrt_gas, seen=seen: seen.append(loss), step=lambda: None)
        ctx = LossContext(clip_low=0.2, clip_high=0.2, tokens=tokens, dp_size=world_size)
        train_phases.train_micro_batch(RankSetup(cfg, 0, world_size, 0), engine, s, 0, ctx, old_from_training=False)
        (loss,) = seen
        (grad,) = torch.autograd.grad(loss, lp)
        losses[kl_coef] = (float(loss.detach()), grad)
    # the estimators of KL(pi || pi_ref) at x = log pi - log pi_ref, written out per token
    pairs = [(float(current[r, 2 + t]), ref[r][t]) for r in (0, 1) for t in (0, 1)]
    per_token = {"k1": lambda x: x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(-x) - 1 + x}[estimator]
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1 - math.exp(-x)}[estimator]
    want = coef * sum(per_token(lp - r) for lp, r in pairs) / tokens * world_size
    assert losses[coef][0] - losses[0.0][0] == pytest.approx(want, rel=1e-5)
    want_grad = torch.zeros_like(current)
    for row in (0, 1):
        for t in (0, 1):
            x = float(current[row, 2 + t]) - ref[row][t]
            want_grad[row, 2 + t] = coef * slope(x) / tokens * world_size
    assert torch.allclose(losses[coef][1] - losses[0.0][1], want_grad, atol=1e-6)
