"""The off-policy correction (algorithms/off_policy.py) wired into both training routes (docs/algorithms/off_policy.md):

- the `--offpolicy.*` flags: presets, overrides, the default, the removed `--async.is_correction / is_cap` refused
  naming their replacement, errors that name the flag, the KL-Cov note under bypass;
- the trainer's step (PolicyActor.train_step and train_phases, on a tiny random model behind a stand-in for the
  DeepSpeed engine that records what it is asked): weights into every objective's loss with rejected tokens kept in
  the mask, `offpolicy/*` metrics by staleness, bypass (no old pass, pi_old = the rollout's log-probs, entropies from
  the training forward, KL-Cov's penalty acting on one optimizer step);
- the OpenRLHF route: its PolicyLoss replacement hands the objective the same weights as the trainer's path on the
  same tensors, and both are OpenRLHF's own formula.
"""

from __future__ import annotations

import math
import random
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors import train_phases
from entropy_openrlhf.actors.forward import SeqBatch
from entropy_openrlhf.actors.policy_actor import PolicyActor
from entropy_openrlhf.actors.step_data import TrainSample, merge_ranks, reduce_micro_batches
from entropy_openrlhf.actors.train_phases import RankSetup, StepState, observe_old
from entropy_openrlhf.algorithms.off_policy import PRESETS, OffPolicyConfig
from entropy_openrlhf.config import ConfigError, build_parser, from_args, validate
from entropy_openrlhf.integrations import openrlhf as route
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.presets import PIPELINES

# ---------------------------------------------------------------------------------------------- the flags


def quiet_validate(cfg) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return validate(cfg)


def test_help_lists_the_offpolicy_flags():
    text = build_parser().format_help()
    for name in ("preset", "is_level", "is_min", "is_max", "reject", "reject_min", "reject_max", "bypass"):
        assert f"--offpolicy.{name}" in text


def test_the_default_is_todays_token_tis_capped_at_2_on_async_runs():
    assert from_args([]).off_policy == OffPolicyConfig(is_level="token", is_max=2.0)  # max_staleness 1: async
    assert from_args(["--async.max_staleness", "0"]).off_policy == PRESETS["none"]
    assert not quiet_validate(from_args([]))  # no note when nothing is set
    # a single field is enough to replace the default: unset fields take OffPolicyConfig's defaults
    assert from_args(["--offpolicy.reject", "token"]).off_policy == OffPolicyConfig(reject="token")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--async.is_correction", "on"], "--offpolicy.preset token_tis (on) or --offpolicy.preset none (off)"),
        (["--async.is_cap=1.5", "--offpolicy.preset", "seq_tis"], "--offpolicy.preset token_tis --offpolicy.is_max"),
    ],
)
def test_the_removed_async_is_flags_are_refused_naming_the_offpolicy_spelling(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        from_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"{argv[0].split('=')[0]} was removed" in err and named in err, err


def test_a_preset_fills_the_fields_and_non_default_fields_override_it():
    cfg = from_args(["--offpolicy.preset", "token_mask", "--offpolicy.reject_max", "3", "--offpolicy.is_min", "0.1"])
    assert cfg.off_policy == OffPolicyConfig(
        is_level="token", is_min=0.1, is_max=5.0, reject="token", reject_min=0.5, reject_max=3.0
    )
    # a field given its default value cannot be told from one left alone: the preset's value stays (documented)
    same = from_args(["--offpolicy.preset", "token_mask", "--offpolicy.is_max", "2.0"])
    assert same.off_policy.is_max == 5.0


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--offpolicy.is_max", "0.5"], "--offpolicy.is_max: 0.5 must be >= 1"),
        (["--offpolicy.reject_min", "1.5"], "--offpolicy.reject_min: 1.5 must be <= 1"),
        (["--offpolicy.is_min", "1.5", "--offpolicy.is_level", "token"], "--offpolicy.is_min: 1.5 must be <= 1"),
        (["--offpolicy.is_min", "3", "--offpolicy.is_level", "token"], "--offpolicy.is_min: 3.0 is above"),
        (["--offpolicy.is_level", "tok"], "--offpolicy.is_level: 'tok' is not one of none, token, sequence"),
        (["--offpolicy.preset", "icepop"], "--offpolicy.preset: 'icepop' is not one of"),
        (["--offpolicy.bypass", "true", "--offpolicy.is_level", "token"], "--offpolicy.bypass: "),
        (["--offpolicy.preset", "bypass", "--offpolicy.reject", "token"], "--offpolicy.bypass: "),
        (["--rollout.top_p", "0.9"], "--rollout.top_p: 0.9 is refused in training"),
    ],
)
def test_bad_settings_are_a_config_error_naming_the_flag(flags, needle):
    with pytest.raises(ConfigError) as e:
        validate(from_args(flags))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_kl_cov_one_step_note_is_not_given_under_bypass():
    plain = quiet_validate(from_args(["--train.mini_batches", "1"], PIPELINES["kl_cov"]))
    assert any("plain policy gradient" in n for n in plain)
    for flags in (["--offpolicy.bypass", "true"], ["--offpolicy.preset", "bypass"]):
        notes = quiet_validate(from_args(["--train.mini_batches", "1", *flags], PIPELINES["kl_cov"]))
        assert not any("plain policy gradient" in n for n in notes)


def test_the_trainer_gives_each_sample_its_staleness():
    from tests.unit.test_rollouts import trainer_with

    trainer = trainer_with("tests.unit.test_rollouts:tool_turn")
    batch = trainer._make_batch(0)  # sampled by policy version 3 (the stand-in engines' sync)
    assert {s.policy_version for g in batch.groups for s in g} == {3}
    assert [t.staleness for t in trainer._train_samples(batch, 5)] == [2] * 4


# ---------------------------------------------------------------------------------------------- the trainer's step


class Engine(torch.nn.Module):
    """The DeepSpeed engine's surface the step uses, around a transformers model: the optimizer step is a no-op (the
    weights never move, so every forward of the step sees the weights it started from), and each forward is counted
    by whether it runs with or without grad."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.module = model
        self.device = torch.device("cpu")
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])
        self.forwards = {"grad": 0, "no_grad": 0}

    def forward(self, **kwargs):
        self.forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return self.module(**kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        loss.backward()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        pass

    def step(self) -> None:
        self.module.zero_grad()

    def was_step_applied(self) -> bool:
        return True

    def get_global_grad_norm(self) -> None:
        return None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def model_log_probs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response token | before it) at T = 1, one sequence alone: no padding, no shared code."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def make_samples(model, n: int = 8, seed: int = 0) -> list[TrainSample]:
    """n responses in groups of 4 per prompt, rollout log-probs off the model's by up to 0.6 nat (so that ratios
    leave a band), staleness 0 and 1 alternating."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1, 5 + i // 4, 6, 7]
        response = [rng.randrange(3, 300) for _ in range(rng.randint(3, 7))]
        rollout = [x + rng.uniform(-0.6, 0.6) for x in model_log_probs(model, prompt, response)]
        out.append(TrainSample(prompt, response, rng.gauss(0.0, 1.0), rollout, staleness=i % 2))
    return out


def step_config(*flags: str, loss: str = "kl_cov", mini: int = 2, micro: int = 2, n: int = 8):
    cfg = from_args(
        ["--rollout.batch_size", str(n // 4), "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", str(mini),
         "--actor.micro_batch_size", str(micro), "--train.shared_prefix", "off", *flags],
        {"loss.type": loss},
    )  # fmt: skip
    cfg.loss.kl_cov.ratio = 0.2
    quiet_validate(cfg)
    return cfg


def run_step(tiny: str, cfg, samples, monkeypatch, steps: int = 1):
    """PolicyActor.train_step on one rank (the actor's own code, on an instance without Ray and DeepSpeed), with
    every call to the objective recorded. Returns (metrics per step, objective calls, engine)."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    engine = Engine(model)
    actor = object.__new__(PolicyActor.__ray_metadata__.modified_class)
    actor.cfg, actor.world_size, actor.version, actor.dropout_free = cfg, 1, 0, True
    actor.setup, actor.engine, actor.phases = RankSetup(cfg, 0, 1, pad_id=0), engine, train_phases
    calls = []
    real = train_phases.run_objective

    def recording(name, params, lc, ctx, lp, old, adv, mask, **kwargs):
        calls.append(SimpleNamespace(ctx=ctx, lp=lp.detach(), old=old, mask=mask, is_weights=kwargs["is_weights"]))
        return real(name, params, lc, ctx, lp, old, adv, mask, **kwargs)

    monkeypatch.setattr(train_phases, "run_objective", recording)
    metrics = [actor.train_step(samples, step) for step in range(steps)]
    return metrics, calls, engine


def valid_values(call, attr: str) -> list[float]:
    return getattr(call, attr)[call.mask.bool()].tolist()


def test_bypass_runs_no_old_pass_and_trains_against_the_rollout_log_probs(tiny, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    samples = make_samples(model)
    rollout = [x for s in samples for x in s.rollout_log_probs]  # the grid's row-major order of valid tokens
    own = [x for s in samples for x in model_log_probs(model, s.prompt_ids, s.response_ids)]

    metrics, calls, engine = run_step(tiny, step_config("--offpolicy.bypass", "true"), samples, monkeypatch, steps=2)
    assert [m["train/old_pass_micro_batches"] for m in metrics] == [0.0, 0.0]
    assert engine.forwards["no_grad"] == 0  # no no-grad forward at all
    assert len(calls) == 2 * 4  # two steps of four micro-batches
    step_old = [x for c in calls[:4] for x in valid_values(c, "old")]
    assert step_old == pytest.approx(rollout, abs=1e-6)  # PPO's ratio is pi_theta / pi_rollout
    assert all(c.is_weights is None for c in calls)  # bypass corrects nothing

    # recompute (the default path): the old pass of all but the first mini-batch, pi_old the model's own
    metrics, calls, engine = run_step(tiny, step_config(), samples, monkeypatch)
    assert metrics[0]["train/old_pass_micro_batches"] == 2 and engine.forwards["no_grad"] == 2
    assert [x for c in calls for x in valid_values(c, "old")] == pytest.approx(own, abs=1e-4)


def test_bypass_takes_entropies_and_gap_metrics_from_the_training_forward(tiny, monkeypatch):
    """The weights do not move in this stand-in, so the training forwards see what the old pass would: the entropy
    and gap metrics under bypass equal the recompute path's without a correction."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    samples = make_samples(model, seed=1)
    (bypass,), _, _ = run_step(tiny, step_config("--offpolicy.bypass", "true"), samples, monkeypatch)
    (recompute,), _, _ = run_step(tiny, step_config("--offpolicy.preset", "none"), samples, monkeypatch)
    keys = [k for k in recompute if k.startswith(("entropy/", "rollout/", "offpolicy/"))]
    assert {"entropy/seq_mean", "rollout/vllm_kl", "offpolicy/kl_k3", "offpolicy/staleness_1/ess"} <= set(keys)
    for key in keys:
        assert bypass[key] == pytest.approx(recompute[key], rel=1e-5, abs=1e-6), key
    assert recompute["offpolicy/kl_k3"] > 1e-3  # the gap is there to see


def test_kl_cov_penalty_acts_with_one_optimizer_step_under_bypass(tiny, monkeypatch):
    """One mini-batch: recomputed, pi_old is the step's own forward and |logp - old| is 0 on every token, so the
    penalty (coef) changes nothing; under bypass pi_old is the rollout's and the penalty is there."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    samples = make_samples(model, seed=2)

    def policy_loss(*flags: str, coef: float) -> tuple[float, float]:
        cfg = step_config(*flags, mini=1, micro=8)
        cfg.loss.kl_cov.coef = coef
        (m,), _, _ = run_step(tiny, cfg, samples, monkeypatch)
        return m["loss/policy"], m["loss/kl_selected"]

    on_policy = [policy_loss("--offpolicy.preset", "none", coef=c) for c in (0.0, 1.0)]
    assert on_policy[1][1] == 0.0 and on_policy[0][0] == pytest.approx(on_policy[1][0], abs=1e-7)
    bypassed = [policy_loss("--offpolicy.bypass", "true", coef=c) for c in (0.0, 1.0)]
    assert bypassed[1][1] > 0.01
    assert bypassed[1][0] - bypassed[0][0] > 1e-3  # coef x the selected tokens' |logp - rollout|, aggregated


def test_the_weights_reach_the_objective_and_rejected_tokens_stay_in_the_mask(tiny, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    samples = make_samples(model, seed=3)
    cfg = step_config("--offpolicy.preset", "token_mask", "--offpolicy.reject_min", "0.8", "--offpolicy.reject_max",
                      "1.25")  # fmt: skip
    (m,), calls, _ = run_step(tiny, cfg, samples, monkeypatch)
    rejected = 0
    # rebuild each micro-batch's rollout grid from the samples, in the order the step cuts them (two per micro-batch,
    # two micro-batches per mini-batch)
    rows = iter(samples)
    for j, c in enumerate(calls):
        grid = torch.zeros_like(c.old)
        for r in range(c.mask.shape[0]):
            s = next(rows)
            cols = c.mask[r].nonzero()[:, 0]
            grid[r, cols] = torch.tensor(s.rollout_log_probs)
        hand = torch.exp(c.old - grid)
        keep = (hand >= 0.8) & (hand <= 1.25) & c.mask.bool()
        torch.testing.assert_close(c.is_weights, torch.where(keep, hand, 0.0), rtol=1e-5, atol=1e-6)
        rejected += int((c.mask.bool() & ~keep).sum())
        # the normaliser counts every valid token of the mini-batch, the rejected ones too
        mini = samples[4 * (j // 2) : 4 * (j // 2) + 4]
        assert c.ctx.tokens == sum(len(s.response_ids) for s in mini)
    assert rejected > 0 and m["offpolicy/rejected_frac"] > 0


def test_staleness_breakdown_is_the_formula_on_each_group(tiny, monkeypatch):
    """One micro-batch of 8 (staleness 0 and 1 alternate): each group's kl_k3 and rejected share by hand, and the
    groups' token shares sum to 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    samples = make_samples(model, seed=4)
    cfg = step_config("--offpolicy.preset", "token_mask", "--offpolicy.reject_min", "0.8", mini=1, micro=8)
    (m,), _, _ = run_step(tiny, cfg, samples, monkeypatch)
    total = sum(len(s.response_ids) for s in samples)
    for v in (0, 1):
        group = [s for s in samples if s.staleness == v]
        logs = [o - r for s in group for o, r in zip(model_log_probs(model, s.prompt_ids, s.response_ids),
                                                     s.rollout_log_probs)]  # fmt: skip
        k3 = sum(math.exp(x) - 1 - x for x in logs) / len(logs)
        out = sum(not 0.8 <= math.exp(x) <= 5.0 for x in logs) / len(logs)
        assert m[f"offpolicy/staleness_{v}/kl_k3"] == pytest.approx(k3, rel=1e-3, abs=1e-6)
        assert m[f"offpolicy/staleness_{v}/rejected_frac"] == pytest.approx(out, abs=1e-9)
        assert m[f"offpolicy/staleness_{v}/token_frac"] == pytest.approx(len(logs) / total)
    assert "offpolicy/staleness_2/kl_k3" not in m


def tempered(model, prompt: list[int], response: list[int], temperature: float) -> tuple[list[float], list[float]]:
    """log_softmax(logits / T) of each response token and the entropy of that distribution, one sequence alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist(), (-(logp.exp() * logp).sum(-1)).tolist()


@pytest.mark.parametrize("bypass", [False, True])
def test_the_step_computes_at_the_sampling_temperature(tiny, monkeypatch, bypass):
    """--rollout.temperature 0.7: the old log-probs (the old pass's and the first mini-batch's training forward),
    the current ones the objective differentiates, and the entropy metric are those of softmax(logits / 0.7)."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    samples = make_samples(model, seed=5)
    flags = ["--rollout.temperature", "0.7", *(["--offpolicy.bypass", "true"] if bypass else [])]
    (m,), calls, _ = run_step(tiny, step_config(*flags), samples, monkeypatch)
    pairs = [tempered(model, s.prompt_ids, s.response_ids, 0.7) for s in samples]
    want_lp = [x for lp, _ in pairs for x in lp]
    assert [x for c in calls for x in valid_values(c, "lp")] == pytest.approx(want_lp, abs=1e-4)
    if not bypass:
        assert [x for c in calls for x in valid_values(c, "old")] == pytest.approx(want_lp, abs=1e-4)
    # entropy/token_mean: each micro-batch's token mean, averaged over the four micro-batches of two samples
    per_micro = [pairs[i][1] + pairs[i + 1][1] for i in range(0, len(pairs), 2)]
    want_entropy = sum(sum(e) / len(e) for e in per_micro) / len(per_micro)
    assert m["entropy/token_mean"] == pytest.approx(want_entropy, rel=1e-4)
    at_one = [x for s in samples for x in model_log_probs(model, s.prompt_ids, s.response_ids)]
    assert max(abs(a - b) for a, b in zip(at_one, want_lp)) > 0.05  # T = 1 would not pass the checks above


def test_weight_max_is_reduced_by_max_and_ranks_keep_their_own_staleness_keys():
    micro = {"offpolicy/weight_max": [1.5, 3.0, 2.0], "offpolicy/weight_mean": [1.0, 2.0, 3.0]}
    reduced = reduce_micro_batches(micro, mini_batches=1, world_size=1)
    assert reduced["offpolicy/weight_max"] == 3.0 and reduced["offpolicy/weight_mean"] == 2.0
    ranks = [
        {"offpolicy/weight_max": 3.0, "offpolicy/staleness_0/kl_k3": 0.1, "train/tokens": 5.0},
        {"offpolicy/weight_max": 4.0, "offpolicy/staleness_1/kl_k3": 0.3, "train/tokens": 7.0},
    ]
    for key in ("loss/policy", "loss/entropy_bonus"):
        for r in ranks:
            r[key] = 0.0
    merged = merge_ranks(ranks)
    assert merged["offpolicy/weight_max"] == 4.0
    assert merged["offpolicy/staleness_0/kl_k3"] == 0.1 and merged["offpolicy/staleness_1/kl_k3"] == 0.3


# ---------------------------------------------------------------------------------------------- the two routes


def make_tensors(seed: int = 0, b: int = 4, length: int = 9):
    """Padded (B, L) old/rollout log-probs and a mask, as both routes receive them (zeros on padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, length - 3, length - 5, 2][:b])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    old = (-torch.rand(b, length, generator=g) * 3) * mask
    rollout = (old + 0.3 * torch.randn(b, length, generator=g)) * mask
    lp = (old + 0.1 * torch.randn(b, length, generator=g)) * mask
    adv = torch.randn(b, 1, generator=g).expand(b, length).clone() * mask
    return lp, old, rollout, adv, mask


def openrlhf_weights(old, rollout, mask, level, mode, low, high):
    """OpenRLHF 0.11.2's ratio gate, from its flag help: token clip clamps the ratio; token mask zeroes tokens whose
    ratio leaves [low, high], keeping the others' full ratio; seq mask does it per response on the geometric mean."""
    ratio = torch.exp(old - rollout)
    if mode == "clip":
        return ratio.clamp(low, high)
    geo = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    stat = ratio if level == "token" else geo
    return torch.where((stat >= low) & (stat <= high), ratio, 0.0)


# OpenRLHF's flags, and the same correction written in our trainer's flags by hand (docs/algorithms/off_policy.md's
# table)
ROUTE_CASES = [
    (("token", "mask", 0.8, 1.25), ["--offpolicy.is_level", "token", "--offpolicy.is_max", "inf",
                                     "--offpolicy.reject", "token", "--offpolicy.reject_min", "0.8",
                                     "--offpolicy.reject_max", "1.25"]),
    (("seq", "mask", 0.9, 1.1), ["--offpolicy.is_level", "token", "--offpolicy.is_max", "inf",
                                 "--offpolicy.reject", "sequence_geo", "--offpolicy.reject_min", "0.9",
                                 "--offpolicy.reject_max", "1.1"]),
    (("token", "clip", 0.8, 1.25), ["--offpolicy.is_level", "token", "--offpolicy.is_min", "0.8",
                                     "--offpolicy.is_max", "1.25"]),
]  # fmt: skip


@pytest.mark.parametrize("openrlhf, ours", ROUTE_CASES, ids=lambda c: "-".join(map(str, c)) if len(c) == 4 else "")
def test_both_routes_give_the_same_weights(openrlhf, ours, monkeypatch):
    from entropy_openrlhf.integrations import openrlhf_adapter as adapter

    level, mode, low, high = openrlhf
    lp, old, rollout, adv, mask = make_tensors(seed=len(ours))

    # the OpenRLHF route: its PolicyLoss replacement, called as training_step calls it
    seen = {}
    real = adapter.run_objective

    def recording(*args, **kwargs):
        seen["weights"] = kwargs["is_weights"]
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "run_objective", recording)
    try:
        cls = route.install("kl_cov", ratio=0.2)
        loss_fn = cls(is_correction_level=level, is_correction_mode=mode, is_correction_threshold=[low, high])
        loss_fn(lp.clone().requires_grad_(True), old, adv, action_mask=mask, rollout_log_probs=rollout)
    finally:
        route.uninstall()

    # our trainer's route: the same tensors as one micro-batch of a step, through observe_old
    cfg = from_args(ours)
    quiet_validate(cfg)
    b = mask.shape[0]
    s = StepState(
        step=0, params=None, off_policy=cfg.off_policy, select_globally=False, needs_entropy=False, bonus_coef=0.0,
        minis=[[0]], batches=[SeqBatch(torch.zeros(b, mask.shape[1] + 1, dtype=torch.long),
                                            torch.ones(b, mask.shape[1] + 1, dtype=torch.long), mask)],
        advantages=[adv], rollout_lp=[rollout], ref_lp=None, old_lp=[old], entropies=[torch.zeros_like(old)],
        is_weights=[None], staleness=[torch.zeros(b, dtype=torch.long)],
    )  # fmt: skip
    observe_old(cfg, s, 0)

    valid = mask.bool()
    hand = openrlhf_weights(old, rollout, mask, level, mode, low, high)
    torch.testing.assert_close(seen["weights"][valid], hand[valid], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s.is_weights[0][valid], seen["weights"][valid], rtol=0, atol=0)
    assert (s.is_weights[0][~valid] == 0).all()
    w = hand[valid]
    assert (w != torch.exp(old - rollout)[valid]).any()  # the correction changed some weight: not vacuous
