"""What the policy actor's own step code decides, on the tiny model, behind tests/unit/policy_harness.py's stand-in for
the DeepSpeed engine (`PolicyActor.train_step` and its phases as they are; two ranks over gloo where a test needs
them): KL-Cov's and Clip-Cov's updates differ from PPO's, the first mini-batch's old log-probs come from its training
forward (a model with dropout keeps the separate pass), the entropy bonus, and a global selection across two ranks.
The batches and configurations are tests/integration/test_policy.py's, which keeps what the real DeepSpeed group adds
(data-parallel ranks against one, ZeRO-3's shards, a skipped non-finite step, the rendezvous)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.step_data import merge_ranks
from entropy_openrlhf.algorithms.entropy_control import MEASURE
from entropy_openrlhf.config import from_args
from tests.integration.test_policy import fixed_batch, max_diff, policy_config
from tests.unit.policy_harness import load_model, make_actor, one_thread, run_ranks, shard, weights


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


SMOKE_STEP = ["--preset", "smoke", "--actor.micro_batch_size", "2", "--actor.lr", "1e-3"]


def micro_batches(cfg, n_samples: int) -> tuple[int, int]:
    """(micro-batches per mini-batch, micro-batches in all) of one rank's train_step on n_samples."""
    per_mini = n_samples // cfg.train.mini_batches
    per_mini_micro = -(-per_mini // cfg.actor.micro_batch_size)
    return per_mini_micro, per_mini_micro * cfg.train.mini_batches


def old_pass_config():
    """KL-Cov with IS weights on (test_policy.py's _step_with_separate_old_pass)."""
    cfg = from_args([*SMOKE_STEP, "--offpolicy.preset", "token_tis"], {"loss.type": "kl_cov"})
    cfg.loss.kl_cov.ratio = 0.1
    return cfg


def bonus_config(coef: float, workers: int):
    """test_policy.py's _bonus_group's flags."""
    return from_args(
        ["--preset", "smoke", "--actor.num_workers", str(workers), "--actor.micro_batch_size", "2",
         "--actor.lr", "1e-3", "--offpolicy.preset", "none", "--loss.entropy_coef", str(coef)],
        {"loss.type": "ppo"},
    )  # fmt: skip


# by name: a Config does not pickle, so the ranks of run_ranks build theirs
CONFIGS = {
    "policy": policy_config,
    "old_pass": old_pass_config,
    "unpacked": lambda: from_args([*SMOKE_STEP, "--train.shared_prefix", "off"]),
    "bonus": bonus_config,
}


def rank_steps(rank: int, world_size: int, model_path: str, config: tuple, plan: list[tuple], dropout_free=None):
    """This rank's share of each step of `plan` ((batch seed, step, entropy_coef) each), on one actor, dealt out as
    PolicyGroup.train_step deals them: the steps' metrics, rank 0's weights after them, and the actor's
    dropout_free. `dropout_free` False forces the separate old-log-prob pass, as a model with dropout gets it."""
    from entropy_openrlhf.actors.chunked_head import use_chunked_head
    from entropy_openrlhf.actors.forward import use_shared_prefix

    name, *args = config
    cfg = CONFIGS[name](*args)
    model = load_model(model_path)
    # what build_policy_engine does to the model before DeepSpeed wraps it (its packing and output head)
    use_shared_prefix(model, cfg.train.shared_prefix)
    use_chunked_head(model, cfg.train.head_chunk_tokens)
    model.config.use_cache = False
    actor = make_actor(cfg, model, rank, world_size)
    if dropout_free is not None:
        actor.dropout_free = dropout_free
    metrics = []
    for seed, step, coef in plan:
        samples, sizes = shard(cfg, fixed_batch(seed=seed), world_size)[rank]
        metrics.append(actor.train_step(samples, step, entropy_coef=coef, micro_sizes=sizes))
    return metrics, weights(model) if rank == 0 else None, actor.dropout_free


def train(model_path: str, config: tuple, plan: list[tuple], workers: int = 1, dropout_free=None):
    """(each step's metrics merged over the ranks, rank 0's weights after the steps, the actor's dropout_free)."""
    if workers == 1:
        results = [rank_steps(0, 1, model_path, config, plan, dropout_free)]
    else:
        results = run_ranks(workers, rank_steps, model_path, config, plan, dropout_free)
    metrics = [merge_ranks([r[0][i] for r in results]) for i in range(len(plan))]
    return metrics, results[0][1], results[0][2]


ONE_STEP = [(0, 0, None)]


def test_clip_cov_and_kl_cov_change_the_update_relative_to_grpo(tiny):
    _, grpo, _ = train(tiny, ("policy", "ppo"), ONE_STEP)
    kl_metrics, kl_cov, _ = train(tiny, ("policy", "kl_cov"), ONE_STEP)
    clip_metrics, clip_cov, _ = train(tiny, ("policy", "clip_cov"), ONE_STEP)
    assert kl_metrics[0]["loss/kl_cov_frac"] > 0
    assert clip_metrics[0]["loss/clip_cov_frac"] > 0
    assert max_diff(grpo, kl_cov) > 1e-6
    assert max_diff(grpo, clip_cov) > 1e-6


def test_global_selection_scope_trains_across_ranks(tiny):
    metrics, trained, _ = train(tiny, ("policy", "kl_cov", 2, "global"), [(0, 0, None), (0, 1, None)], workers=2)
    assert all(torch.isfinite(w).all() for w in trained.values())
    # 10 % of the valid tokens of each mini-batch, selected once over both ranks
    assert metrics[1]["loss/kl_cov_frac"] == pytest.approx(0.1, abs=0.05)


def test_first_mini_batch_old_log_probs_from_its_training_forward(tiny, tmp_path):
    """The first mini-batch's old log-probs come from its training forward (the weights have not moved): the step and
    every old-log-prob metric equal the separate no-grad pass's. The two paths give the same numbers, so the count
    of micro-batches the separate pass computed is what shows which one ran. A model with dropout keeps the separate
    pass."""
    initial = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny).state_dict().items()}
    (reused_metrics,), reused, _ = train(tiny, ("old_pass",), ONE_STEP)
    (separate_metrics,), separate, _ = train(tiny, ("old_pass",), ONE_STEP, dropout_free=False)
    update = max_diff(separate, {k: initial[k] for k in separate})
    assert update > 1e-4  # the step moved the weights
    assert max_diff(reused, separate) < 1e-4 * update
    for key in ("entropy/seq_mean", "rollout/vllm_kl", "offpolicy/weight_mean", "loss/kl_cov_frac"):
        assert reused_metrics[key] == pytest.approx(separate_metrics[key], rel=1e-5, abs=1e-7), key
    first, total = micro_batches(from_args(SMOKE_STEP), len(fixed_batch()))
    assert first < total  # more than one mini-batch: the separate pass has work either way
    assert reused_metrics["train/old_pass_micro_batches"] == total - first  # all but the first mini-batch's
    assert separate_metrics["train/old_pass_micro_batches"] == total

    # a model with attention dropout: its training forward is not the eval forward, so every micro-batch takes the
    # separate pass (packing refuses dropout in training, hence shared_prefix off)
    dropout_model = tmp_path / "dropout"
    AutoModelForCausalLM.from_pretrained(tiny, attention_dropout=0.1).save_pretrained(dropout_model)
    (metrics,), _, dropout_free = train(str(dropout_model), ("unpacked",), ONE_STEP)
    assert dropout_free is False
    assert metrics["train/old_pass_micro_batches"] == total


def test_entropy_bonus_changes_the_update_and_logs_its_metrics(tiny):
    """--loss.entropy_coef > 0 adds -alpha * H to the loss: the step moves the weights elsewhere than the same step
    without it, and logs the bonus (alpha times the aggregated entropy, summed over the ranks' shares: about alpha
    times the batch's token-mean entropy) and the coefficient in use. The coefficient train_step is given (the
    entropy controller's) overrides the flag; at 0 nothing is added."""
    (plain_metrics,), plain, _ = train(tiny, ("bonus", 0.0, 1), ONE_STEP)
    assert plain_metrics["loss/entropy_bonus"] == 0.0 and plain_metrics["loss/entropy_coef"] == 0.0

    coef = 0.5
    (metrics, override), with_bonus, _ = train(tiny, ("bonus", coef, 2), [(0, 0, None), (1, 1, 0.0)], workers=2)
    assert metrics["loss/entropy_coef"] == coef
    assert MEASURE in metrics  # what the entropy controller reads (it refuses a step without it)
    assert metrics["loss/entropy_bonus"] == pytest.approx(coef * metrics["entropy/token_mean"], rel=0.05)
    assert max_diff(plain, with_bonus) > 1e-5
    # the policy loss itself is the same objective on the same batch and starting weights
    assert metrics["loss/policy"] == pytest.approx(plain_metrics["loss/policy"], rel=0.05, abs=1e-4)
    assert override["loss/entropy_coef"] == 0.0 and override["loss/entropy_bonus"] == 0.0
