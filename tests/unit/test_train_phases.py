"""A step's preparation on a policy rank (actors/train_phases.py::prepare_step): the loss mask each micro-batch
carries, narrowed by the samples' response masks, and the settings the loss context takes from the config."""

from types import SimpleNamespace

import torch

from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.actors.train_phases import RankSetup, prepare_step
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

    def pooled_selection(pooled, select, with_entropy):
        seen.append(float(pooled[0].log_probs.flatten()[0]))
        return [None] * len(pooled), (0.0, 0.0), 0, {}

    monkeypatch.setattr(train_phases, "pooled_selection", pooled_selection)
    for epoch, mini in ((0, 0), (0, 1), (1, 0), (1, 1)):
        update = epoch * len(s.minis) + mini  # optimizer_step's count of the step's optimizer steps
        train_phases.select_globally(RankSetup(cfg, 0, 1, 0), ENGINE, s, update, s.minis[mini], LossContext())
    assert seen == [-1.0, -2.0, -2.0, -2.0]
