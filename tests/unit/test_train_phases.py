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
