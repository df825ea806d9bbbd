"""Token-budget micro-batches (`--train.max_tokens_per_micro_batch`) on the real DeepSpeed policy group: the same
step as the fixed split of `--actor.micro_batch_size` sequences gives the same weights (and again with the output
head in chunks, `--train.head_chunk_tokens`), for token_mean and seq_mean_token_mean, with two ZeRO-3 ranks that get
different numbers of real micro-batches (one runs empty stand-ins) and a different number of micro-batches per
mini-batch than DeepSpeed's configured gradient accumulation.

The loss is normalised over the whole mini-batch on all ranks, so the split cannot change the gradient; what could
go wrong is the plumbing: a stand-in that adds to the loss or the normaliser, an optimizer step at the wrong
micro-batch (DeepSpeed's boundary), a rank that hangs waiting for the other's collective. As in
test_update_reference.py, AdamW's eps of 1 makes the update proportional to the gradient, so the weights compare
gradients; a step on half the batch misses by far (checked), so the tolerance can fail.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.micro_batches import token_layout
from entropy_openrlhf.actors.policy import PolicyGroup, TrainSample
from entropy_openrlhf.config import from_args

pytestmark = pytest.mark.integration

N, MINI, WORKERS, BUDGET = 16, 2, 2, 30
# four prompts of four responses: one very long response beside short ones, a prompt of middling ones, and two of
# mixed lengths, so that the budget cuts them unlike the fixed split
RESPONSE_LENGTHS = [56, 1, 1, 1, 16, 16, 16, 16, 10, 3, 20, 8, 5, 5, 12, 7]


def make_samples() -> list[TrainSample]:
    rng = random.Random(7)
    samples = []
    for i, length in enumerate(RESPONSE_LENGTHS):
        prompt = [1, 5 + i // 4, 6, 7 + i // 4 % 3]
        response = [rng.randrange(3, 300) for _ in range(length)]
        samples.append(TrainSample(prompt, response, rng.gauss(0.0, 1.0), [-2.0] * length))
    return samples


def config(agg: str, shared_prefix: str, budget: int, head_chunk: int = 0):
    return from_args(
        ["--preset", "smoke", "--train.seed", "3", "--train.mini_batches", str(MINI),
         "--actor.num_workers", str(WORKERS), "--actor.micro_batch_size", "2", "--actor.lr", "0.05",
         "--actor.adam_eps", "1.0", "--actor.grad_clip", "1.0", "--loss.agg", agg, "--offpolicy.preset", "none",
         "--train.shared_prefix", shared_prefix, "--train.max_tokens_per_micro_batch", str(budget),
         "--train.head_chunk_tokens", str(head_chunk)],
        {"loss.type": "ppo"},
    )  # fmt: skip


def one_step(model_path: str, cfg, samples) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    group = PolicyGroup(cfg, model_path)
    try:
        metrics = group.train_step(samples, 0)
        weights = group.call_all("export_weights")[0]
    finally:
        group.shutdown()
    return weights, metrics


def steps_from_one_start(model_path: str, cfg, runs: list, ckpt: str) -> list[tuple[dict, dict]]:
    """(weights, metrics) of one step from the group's initial state for each (token budget, samples) of `runs`, on
    one group: its state is saved before the first step and loaded back before each other one (a DeepSpeed
    checkpoint brings back the weights, optimizer and schedule bit for bit,
    test_resume.py::test_policy_checkpoint_restores_weights_optimizer_and_rng). The budget is the driver's to apply
    (PolicyGroup.train_step cuts the micro-batches and sends their sizes), so one group serves every budget."""
    group = PolicyGroup(cfg, model_path)
    out = []
    try:
        group.call_all("save_checkpoint", ckpt, "initial")
        for i, (budget, samples) in enumerate(runs):
            if i:
                group.call_all("load_checkpoint", ckpt, "initial")
            group.cfg.train.max_tokens_per_micro_batch = budget
            metrics = group.train_step(samples, 0)
            out.append((group.call_all("export_weights")[0], metrics))
    finally:
        group.shutdown()
    return out


# with shared-prefix packing off the ranks' shares are balanced sample by sample and one rank runs a stand-in; with it
# on a prompt's responses go to one rank together
@pytest.mark.parametrize("agg, shared_prefix, stand_ins", [("token_mean", "off", True),
                                                           ("seq_mean_token_mean", "on", False)])  # fmt: skip
def test_a_token_budget_gives_the_fixed_splits_step(ray_cluster, tiny_model, tmp_path, agg, shared_prefix, stand_ins):
    samples = make_samples()
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    layout = token_layout(lengths, [tuple(s.prompt_ids) for s in samples], MINI, WORKERS, BUDGET,
                          keep_groups=shared_prefix != "off")  # fmt: skip
    counts = [[len(mini) for mini in rank] for rank in layout.ranks]
    real = [sum(1 for mini in rank for micro in mini if micro) for rank in layout.ranks]
    # what the case is meant to exercise: more micro-batches than the fixed split's 2 per mini-batch (more than
    # DeepSpeed's configured accumulation), and in one case a rank with fewer real ones than the other
    assert max(c for rank in counts for c in rank) > 2, counts
    assert (real[0] != real[1]) == stand_ins, (counts, real)

    initial = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().items()}
    # the fixed split, the budget, and the control below (the budget's step on half the batch), from one start
    (fixed, _), (budget, metrics), (half, _) = steps_from_one_start(
        tiny_model, config(agg, shared_prefix, 0), [(0, samples), (BUDGET, samples), (BUDGET, samples[: N // 2])],
        str(tmp_path / "ckpt"),
    )  # fmt: skip

    def deviation(a: dict, b: dict) -> float:
        return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

    update = deviation(fixed, initial)
    assert update > 1e-3
    print(f"\n{agg}/{shared_prefix}: update {update:.3g}, deviation {deviation(budget, fixed):.3g}")
    assert deviation(budget, fixed) < 1e-4 * update
    # the step's micro-batch metrics: the count each rank ran, the real ones' tokens within the budget
    assert metrics["train/micro_batches"] == sum(counts[0]) == sum(counts[1])
    assert 0 < metrics["train/micro_batch_tokens_mean"] <= metrics["train/micro_batch_tokens_max"]
    assert metrics["train/micro_batch_tokens_max"] <= max(BUDGET, max(lengths))

    # the output head in chunks of 7 response tokens (--train.head_chunk_tokens) on top: the same step again
    chunked, _ = one_step(tiny_model, config(agg, shared_prefix, BUDGET, head_chunk=7), samples)
    assert deviation(chunked, fixed) < 1e-4 * update

    # the control: the same step on half the batch moves the weights elsewhere, far beyond the tolerance
    assert deviation(half, fixed) > 100 * 1e-4 * update
