"""The policy actor's update against the reference step of tests/integration/test_update_reference.py, for the cases
whose part of the step is the actor's own code: an objective's loss and token selection inside a micro-batch
(Clip-Cov, high_entropy, CISPO, GSPO, KL-Cov among the high-entropy tokens), one or two ranks' packing, two passes
over the batch. `PolicyActor.train_step` and its phases run as they are (tests/unit/policy_harness.py), behind the
harness's stand-in for the DeepSpeed engine (torch's AdamW and gradient clipping, the gradients averaged over the
gloo ranks at the accumulation boundary); the reference and every check are the integration test's own
(`check_one_step`, `check_two_passes`). The real DeepSpeed group takes the same checks there in the cases that make
DeepSpeed do something different (one rank and two, both selection scopes, LoRA under ZeRO-2 and ZeRO-3)."""

from __future__ import annotations

import pytest
import torch

from entropy_openrlhf.actors.step_data import merge_ranks
from tests.integration.test_update_reference import (
    HARNESS_CASES,
    HARNESS_TWO_PASS_CASES,
    STEP,
    check_one_step,
    check_two_passes,
    config,
    make_batch,
)
from tests.unit.policy_harness import load_model, make_actor, one_thread, run_ranks, shard, weights


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def rank_step(rank: int, world_size: int, case: dict, model_path: str, samples) -> tuple[dict, dict | None]:
    """One rank's share of the step, dealt out as PolicyGroup.train_step deals it: its metrics, and rank 0's weights
    after the step (what the group exports). `case`: config()'s arguments (a Config does not pickle)."""
    from entropy_openrlhf.actors.chunked_head import use_chunked_head
    from entropy_openrlhf.actors.forward import use_shared_prefix

    cfg = config(**case)
    model = load_model(model_path)
    # what build_policy_engine does to the model before DeepSpeed wraps it (its packing and output head)
    use_shared_prefix(model, cfg.train.shared_prefix)
    use_chunked_head(model, cfg.train.head_chunk_tokens)
    model.config.use_cache = False
    shard_samples, sizes = shard(cfg, samples, world_size)[rank]
    metrics = make_actor(cfg, model, rank, world_size).train_step(shard_samples, STEP, micro_sizes=sizes)
    return metrics, weights(model) if rank == 0 else None


def harness_step(case: dict, model_path: str, samples) -> tuple[dict, dict, dict]:
    """(the initial weights, the merged metrics, rank 0's weights after the step), as actor_step gives them for the
    real group: one rank in this process, two over gloo."""
    initial = {k: v.detach() for k, v in load_model(model_path).state_dict().items()}
    workers = case["workers"]
    if workers == 1:
        results = [rank_step(0, 1, case, model_path, samples)]
    else:
        results = run_ranks(workers, rank_step, case, model_path, samples)
    return initial, merge_ranks([m for m, _ in results]), results[0][1]


@pytest.mark.parametrize("loss, scope, workers, shared_prefix, within, lora", HARNESS_CASES)
def test_one_actor_step_equals_the_reference_step(tiny, loss, scope, workers, shared_prefix, within, lora):
    case = dict(loss=loss, scope=scope, workers=workers, shared_prefix=shared_prefix, within=within, lora=lora)
    cfg = config(**case)
    samples, old_rows = make_batch(tiny)
    initial, metrics, actor = harness_step(case, tiny, samples)
    assert all(torch.isfinite(w).all() for w in actor.values())
    check_one_step(tiny, cfg, loss, scope, workers, within, samples, old_rows, initial, metrics, actor)


@pytest.mark.parametrize("loss, scope, workers, shared_prefix", HARNESS_TWO_PASS_CASES)
def test_two_passes_over_the_batch_equal_the_reference_steps(tiny, loss, scope, workers, shared_prefix):
    case = dict(loss=loss, scope=scope, workers=workers, shared_prefix=shared_prefix, epochs=2)
    cfg = config(**case)
    samples, old_rows = make_batch(tiny)
    initial, metrics, actor = harness_step(case, tiny, samples)
    check_two_passes(tiny, cfg, loss, scope, workers, shared_prefix, samples, old_rows, initial, metrics, actor)
