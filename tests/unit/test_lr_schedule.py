"""The learning-rate schedule (`--actor.lr_scheduler`, actors/policy_engine.py::build_lr_scheduler) on a plain torch
optimizer: the rate of every optimizer step against the formulas written out here, its length counted in optimizer
steps, and a schedule restored from its state dict (what DeepSpeed's checkpoints hold) going on where it stopped.
DeepSpeed stepping it once per optimizer step is checked by scripts/gpu_check.py's CPU twin (tests/integration)."""

import math

import pytest
import torch

from entropy_openrlhf.actors.policy_engine import build_lr_scheduler, total_optimizer_steps
from entropy_openrlhf.config import ConfigError, from_args, validate

LR = 3e-5


def want(name: str, k: int, warmup: int, ratio: float, total: int) -> float:
    """The rate of optimizer step k (from 0): linear warmup from 0, then constant, or a cosine or a straight line
    from LR down to ratio x LR at step `total`."""
    if k < warmup:
        return LR * k / warmup
    if name == "constant":
        return LR
    progress = (k - warmup) / (total - warmup)
    if name == "cosine":
        return LR * (ratio + (1 - ratio) * (1 + math.cos(math.pi * progress)) / 2)
    return LR * (ratio + (1 - ratio) * (1 - progress))


def rates(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, steps: int) -> list:
    """The rate each of `steps` optimizer steps runs at, the scheduler stepped after each, as DeepSpeed does."""
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=LR)


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize(("name", "ratio"), [("constant", 0.0), ("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0),
                                             ("linear", 0.25)])  # fmt: skip
def test_each_optimizer_step_runs_at_the_formula_s_rate(name, ratio, warmup):
    total = 12
    opt = optimizer()
    seen = rates(build_lr_scheduler(opt, name, warmup, ratio, total), opt, total + 1)
    assert seen == pytest.approx([want(name, k, warmup, ratio, total) for k in range(total + 1)], rel=1e-12, abs=1e-20)
    if warmup:
        assert seen[0] == 0.0 and seen[warmup] == pytest.approx(LR)  # the warmup starts at 0 and ends at the peak
    if name != "constant":
        assert seen[total] == pytest.approx(ratio * LR, abs=1e-20)  # the decay ends at min_lr_ratio x lr
        assert seen[warmup + 1] < seen[warmup]


def test_a_schedule_restored_from_its_state_goes_on_where_it_stopped():
    opt = optimizer()
    sched = build_lr_scheduler(opt, "cosine", 2, 0.1, 10)
    first = rates(sched, opt, 4)
    saved_sched, saved_opt = sched.state_dict(), opt.state_dict()
    rest = rates(sched, opt, 6)

    # a new run: a fresh optimizer and schedule (at step 0), then the checkpoint's state
    opt2 = optimizer()
    sched2 = build_lr_scheduler(opt2, "cosine", 2, 0.1, 10)
    assert opt2.param_groups[0]["lr"] == 0.0
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert rates(sched2, opt2, 6) == rest
    assert first + rest == pytest.approx([want("cosine", k, 2, 0.1, 10) for k in range(10)], rel=1e-12, abs=1e-20)


def test_the_schedule_spans_the_run_s_optimizer_steps():
    cfg = from_args(["--train.num_steps", "7", "--train.mini_batches", "4"])
    assert total_optimizer_steps(cfg) == 28
    # each pass over a step's batch (--train.ppo_epochs) steps the optimizer once per mini-batch
    assert total_optimizer_steps(from_args(["--train.num_steps", "7", "--train.mini_batches", "4",
                                            "--train.ppo_epochs", "3"])) == 84  # fmt: skip


def test_a_warmup_as_long_as_the_run_is_refused_counting_the_passes():
    flags = ["--train.num_steps", "2", "--train.mini_batches", "2", "--actor.lr_warmup_steps", "6"]
    with pytest.raises(ConfigError, match="--actor.lr_warmup_steps: 6 is not below the run's 4 optimizer steps"):
        validate(from_args(flags))
    validate(from_args([*flags, "--train.ppo_epochs", "2"]))  # 8 optimizer steps: the warmup fits


def test_an_unknown_schedule_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--actor.lr_scheduler 'step'"):
        build_lr_scheduler(optimizer(), "step", 0, 0.0, 10)
