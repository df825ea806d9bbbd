"""The OpenRLHF route's adapter (entropy_openrlhf/integrations/), called exactly as OpenRLHF 0.11.2's
`ActorPPOTrainer.training_step` calls `PolicyLoss`:

    loss_fn(log_probs, old_log_probs, advantages, action_mask=..., rollout_log_probs=..., **loss_batch_info)

with `loss_batch_info = {"dp_size", "batch_num_tokens", "global_batch_size"}` as `ppo_train` builds it. The `ppo`
objective is compared with OpenRLHF's own PolicyLoss (an implementation we did not write), the covariance
objectives with our loss functions fed importance weights computed here by hand; padded and packed layouts.
"""

import math
import sys

import pytest
import torch

from entropy_openrlhf.algorithms.losses import clip_cov_loss, high_entropy_loss, kl_cov_loss
from entropy_openrlhf.compat import ensure_flash_attn_importable
from entropy_openrlhf.integrations import openrlhf as route
from entropy_openrlhf.integrations import openrlhf_cli as cli

ensure_flash_attn_importable()  # openrlhf.models imports flash-attn, which CPU machines lack

D, GAS = 2, 2  # data-parallel ranks and accumulation steps the normalisers below stand for


@pytest.fixture(autouse=True)
def _restore_openrlhf():
    yield
    route.uninstall()


def make_batch(seed: int = 0, b: int = 4, length: int = 9, spread: float = 0.3):
    """Padded (B, L) tensors as training_step passes them: masked positions hold 0 in every input (OpenRLHF pads
    with zeros), advantages are per response (GRPO), old/rollout log-probs differ from the current ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, length - 3, length - 5, 2][:b])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    mask[0, 0] = 0  # a prompt token inside the grid, as with multi-turn action spans
    lp = (-torch.rand(b, length, generator=g) * 3) * mask
    old = (lp + spread * torch.randn(b, length, generator=g)) * mask
    rollout = (old + 0.5 * torch.randn(b, length, generator=g)) * mask
    adv = torch.randn(b, 1, generator=g).expand(b, length).clone() * mask
    return lp, old, rollout, adv, mask


def loss_batch_info(mask: torch.Tensor) -> dict:
    """What iter_grad_accum_global_norm hands a micro-batch: the step's counts over all ranks, divided by the
    accumulation steps (here: this micro-batch stands for 1 of D*GAS equal ones)."""
    tokens = mask.sum() * D * GAS
    sequences = (mask.sum(-1) > 0).sum() * D * GAS
    return {"dp_size": D, "batch_num_tokens": tokens / GAS, "global_batch_size": sequences.float() / GAS}


def packed(*tensors: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The same valid tokens as one (1, N) row, the layout of packed samples."""
    keep = mask.bool()
    return [t[keep][None, :] for t in tensors] + [mask[keep][None, :]]


def call(loss_fn, lp, old, adv, mask, rollout, info):
    lp = lp.clone().requires_grad_(True)
    out = loss_fn(lp, old, adv, action_mask=mask, rollout_log_probs=rollout, **info)
    out[0].backward()
    return out, lp.grad


def hand_is_weights(old, rollout, low, high):
    """OpenRLHF's token-level 'mask' correction with the ratio gate, written from its flag help: a token whose ratio
    pi_train / pi_rollout leaves [low, high] gets weight 0, the others their ratio."""
    w = torch.exp(old - rollout)
    return torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))


# ---------------------------------------------------------------- the ppo objective against OpenRLHF's own loss

IS_CASES = [
    {},
    {"is_correction_level": "token", "is_correction_threshold": [0.8, 1.25]},
    {"is_correction_level": "seq", "is_correction_threshold": [0.9, 1.1]},
    {"is_correction_level": "token", "is_correction_mode": "clip", "is_correction_threshold": [0.8, 1.25]},
    {"token_level_loss": False, "dual_clip": 3.0, "clip_eps_high": 0.28},
    {"token_level_loss": False, "is_correction_level": "token", "is_correction_threshold": [0.8, 1.25]},
]


@pytest.mark.parametrize("kwargs", IS_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "plain")
def test_ppo_objective_matches_openrlhf_policy_loss(kwargs):
    from openrlhf.models.loss import PolicyLoss

    cls = route.install("ppo")
    lp, old, rollout, adv, mask = make_batch()
    info = loss_batch_info(mask)
    ours, g_ours = call(cls(**kwargs), lp, old, adv, mask, rollout, info)
    theirs, g_theirs = call(PolicyLoss(**kwargs), lp, old, adv, mask, rollout, info)
    assert len(ours) == len(theirs) == 5
    for name, a, b in zip(("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), ours, theirs):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-7), name
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-7)
    if kwargs.get("is_correction_level", "off") != "off":
        assert 0 < ours[4].item() < 1  # the gate filtered some units but not all: the case is not vacuous


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"is_correction_gating": "binary_kl", "is_correction_threshold": [0.0, 0.02]},
         "--algo.advantage.is_correction_gating binary_kl: "),
        ({"is_correction_gating": "tv", "is_correction_threshold": [0.0, 0.1]},
         "--algo.advantage.is_correction_gating tv: "),
        ({"is_correction_threshold": [1.1, 2.0]}, "--algo.advantage.is_correction_threshold 1.1 2: "),
    ],
)  # fmt: skip
def test_corrections_without_an_equivalent_are_refused_naming_the_flag(kwargs, needle):
    """The binary_kl and tv gates read a statistic our off-policy correction does not compute; a band without ratio
    1 in it would drop on-policy tokens. Refused in one line, at construction and by the command line."""
    cls = route.install("ppo")
    with pytest.raises(ValueError) as e:
        cls(is_correction_level="token", **kwargs)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)
    cls(**kwargs)  # level off (the default): nothing to map, nothing refused


def test_without_global_normaliser_the_loss_is_this_calls_token_mean():
    from openrlhf.models.loss import PolicyLoss

    cls = route.install("ppo")
    lp, old, rollout, adv, mask = make_batch(seed=3)
    ours, g_ours = call(cls(), lp, old, adv, mask, rollout, {})
    theirs, g_theirs = call(PolicyLoss(), lp, old, adv, mask, rollout, {})
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    torch.testing.assert_close(g_ours, g_theirs)


# ---------------------------------------------------------------- covariance objectives against our functions


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("is_on", [False, True], ids=["no_is", "is_token"])
def test_kl_cov_matches_our_function(layout, is_on):
    cls = route.install("kl_cov", ratio=0.2, coef=0.7)
    lp, old, rollout, adv, mask = make_batch(seed=1)
    info = loss_batch_info(mask)  # normalisers of the step: the same whichever layout carries the tokens
    if layout == "packed":
        lp, old, rollout, adv, mask = packed(lp, old, rollout, adv, mask=mask)
    kwargs = {"is_correction_level": "token", "is_correction_threshold": [0.7, 1.4]} if is_on else {}
    out, grad = call(cls(**kwargs), lp, old, adv, mask, rollout, info)

    weights = hand_is_weights(old, rollout, 0.7, 1.4) if is_on else None
    expected_lp = lp.clone().requires_grad_(True)
    expected = kl_cov_loss(
        expected_lp, old, adv, mask, ratio=0.2, coef=0.7, normalizer=float(info["batch_num_tokens"]), dp_size=D,
        is_weights=weights,
    )  # fmt: skip
    expected.loss.backward()
    assert out[0].item() == pytest.approx(expected.loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_lp.grad)
    assert expected.metrics["kl_cov_frac"] > 0 and expected_lp.grad.abs().sum() > 0
    assert float(out[1]) == 0.0  # KL-Cov has no clip
    # OpenRLHF's ppo_kl (k1 over valid tokens), not KL-Cov's |d|
    assert float(out[2]) == pytest.approx(float(((old - lp) * mask).sum() / mask.sum()), rel=1e-6)
    if is_on:
        assert float(out[3]) == pytest.approx(float(((rollout - old) * mask).sum() / mask.sum()), rel=1e-6)


def test_packed_and_padded_layouts_give_the_same_loss_and_gradient():
    cls = route.install("kl_cov", ratio=0.2)
    lp, old, rollout, adv, mask = make_batch(seed=2)
    info = loss_batch_info(mask)
    out_pad, g_pad = call(cls(), lp, old, adv, mask, rollout, info)
    p_lp, p_old, p_roll, p_adv, p_mask = packed(lp, old, rollout, adv, mask=mask)
    out_pack, g_pack = call(cls(), p_lp, p_old, p_adv, p_mask, p_roll, info)
    assert out_pad[0].item() == pytest.approx(out_pack[0].item(), rel=1e-6)
    torch.testing.assert_close(g_pad[mask.bool()][None, :], g_pack)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_clip_cov_matches_our_function(layout):
    # a band and quota that take every candidate, so the draw's order does not matter and the check is exact
    cls = route.install("clip_cov", ratio=1.0, lb=0.05, ub=0.6)
    lp, old, rollout, adv, mask = make_batch(seed=4, spread=0.05)
    info = loss_batch_info(mask)
    if layout == "packed":
        lp, old, rollout, adv, mask = packed(lp, old, rollout, adv, mask=mask)
    out, grad = call(cls(clip_eps_low=1.0, clip_eps_high=1.0), lp, old, adv, mask, rollout, info)
    expected_lp = lp.clone().requires_grad_(True)
    expected = clip_cov_loss(
        expected_lp, old, adv, mask, ratio=1.0, cov_lb=0.05, cov_ub=0.6, clip_low=1.0, clip_high=1.0,
        normalizer=float(info["batch_num_tokens"]), dp_size=D,
    )  # fmt: skip
    expected.loss.backward()
    assert 0 < expected.metrics["clip_cov_frac"] < 1  # some tokens stopped, not all
    assert out[0].item() == pytest.approx(expected.loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_lp.grad)


def test_clip_cov_draw_is_seeded():
    lp, old, rollout, adv, mask = make_batch(seed=5, spread=0.05)
    info = loss_batch_info(mask)

    def loss_with(seed):
        cls = route.install("clip_cov", ratio=0.05, lb=0.0, ub=10.0, seed=seed)
        return call(cls(clip_eps_low=1.0, clip_eps_high=1.0), lp, old, adv, mask, rollout, info)[0][0].item()

    assert loss_with(1) == loss_with(1)
    assert len({loss_with(s) for s in range(6)}) > 1  # different seeds stop different tokens


def test_sequence_mean_normaliser_is_openrlhfs_global_batch_size():
    cls = route.install("kl_cov", ratio=0.2)
    lp, old, rollout, adv, mask = make_batch(seed=6)
    info = loss_batch_info(mask)
    out, grad = call(cls(token_level_loss=False), lp, old, adv, mask, rollout, info)
    expected_lp = lp.clone().requires_grad_(True)
    expected = kl_cov_loss(
        expected_lp, old, adv, mask, ratio=0.2, agg="seq_mean_token_mean",
        normalizer=float(info["global_batch_size"]), dp_size=D,
    )  # fmt: skip
    expected.loss.backward()
    assert out[0].item() == pytest.approx(expected.loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_lp.grad)


def test_entropy_objectives_read_the_entropy_the_trainer_hands_them():
    cls = route.install("high_entropy", top_frac=0.3)
    lp, old, rollout, adv, mask = make_batch(seed=7)
    entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(7)) * mask
    loss_fn = cls()
    with pytest.raises(ValueError, match="selects by token entropy"):
        call(loss_fn, lp, old, adv, mask, rollout, {})
    loss_fn.entropy = entropy
    out, grad = call(loss_fn, lp, old, adv, mask, rollout, loss_batch_info(mask))
    expected_lp = lp.clone().requires_grad_(True)
    # per micro-batch, as the authors: the mean over this call's selected tokens (DeepSpeed averages the calls)
    expected = high_entropy_loss(expected_lp, old, adv, mask, entropy, top_frac=0.3)
    expected.loss.backward()
    assert out[0].item() == pytest.approx(expected.loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_lp.grad)
    assert loss_fn.entropy is None  # consumed: the next micro-batch cannot reuse a stale one


def test_metrics_are_named_as_our_trainer_logs_them():
    cls = route.install("kl_cov", ratio=0.2)
    loss_fn = cls()
    lp, old, rollout, adv, mask = make_batch(seed=8)
    call(loss_fn, lp, old, adv, mask, rollout, loss_batch_info(mask))
    m = loss_fn.last_metrics
    assert {"loss/kl_cov_frac", "loss/kl_selected", "loss/ppo_kl", "cov/mean", "cov/max"} <= set(m)
    n_valid = int(mask.sum())
    assert m["loss/kl_cov_frac"] == pytest.approx(max(1, math.floor(0.2 * n_valid)) / n_valid)


def test_within_selection_reports_its_overlap():
    cls = route.install("kl_cov", ratio=0.2, within="high_entropy", objectives={"high_entropy": {"top_frac": 0.5}})
    loss_fn = cls()
    assert loss_fn.needs_entropy
    lp, old, rollout, adv, mask = make_batch(seed=9)
    loss_fn.entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(9))
    call(loss_fn, lp, old, adv, mask, rollout, {})
    assert "select/overlap_cov_entropy" in loss_fn.last_metrics
    n_valid = int(mask.sum())
    assert loss_fn.last_metrics["select/within_frac"] == pytest.approx(int(0.5 * n_valid + 0.9999) / n_valid)


# ---------------------------------------------------------------- install, guard, settings


def test_install_patches_and_uninstall_restores():
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models.loss import PolicyLoss

    step = ppo_actor.ActorPPOTrainer.training_step
    cls = route.install("kl_cov")
    assert ppo_actor.PolicyLoss is cls and cls.params.ratio == 2e-3
    assert ppo_actor.ActorPPOTrainer.training_step.__entropy_openrlhf_wrapped__ is step
    assert route.install("clip_cov", ratio=1e-3) is ppo_actor.PolicyLoss  # a second install replaces the first
    assert ppo_actor.ActorPPOTrainer.training_step.__entropy_openrlhf_wrapped__ is step  # wrapped once
    route.uninstall()
    assert ppo_actor.PolicyLoss is PolicyLoss and ppo_actor.ActorPPOTrainer.training_step is step


def test_policy_loss_type_gspo_conflicts_with_the_objective():
    cls = route.install("kl_cov")
    with pytest.raises(ValueError, match="--actor.policy_loss_type gspo"):
        cls(policy_loss_type="gspo")


def test_version_guard_fails_in_one_line(monkeypatch):
    real = route.importlib.metadata.version
    monkeypatch.setattr(route.importlib.metadata, "version", lambda n: "0.12.0" if n == "openrlhf" else real(n))
    with pytest.raises(route.OpenRLHFMismatch) as e:
        route.install("kl_cov")
    assert "\n" not in str(e.value) and "0.12.0" in str(e.value) and "0.11.2" in str(e.value)


def test_signature_guard_fails_in_one_line(monkeypatch):
    from openrlhf.models.loss import PolicyLoss

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None, entropy=None):  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(PolicyLoss, "forward", forward)
    with pytest.raises(route.OpenRLHFMismatch) as e:
        route.install("kl_cov")
    assert "\n" not in str(e.value) and "PolicyLoss.forward" in str(e.value) and "entropy" in str(e.value)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("kl_cov", {"ratio": 0.2, "k_percent": 1}, "--objective.k_percent: objective 'kl_cov' has no setting"),
        ("kl_cov", {"ratio": 2.0}, "--objective.ratio: 2.0 must be a fraction"),
        ("kl_conv", {}, "did you mean kl_cov?"),
        ("clip_cov", {"within": "ppo"}, "--objective.within 'ppo': must name another selecting objective"),
    ],
)
def test_bad_settings_fail_in_one_line(name, params, message):
    with pytest.raises(ValueError) as e:
        route.install(name, **params)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the command line


def test_split_argv_keeps_openrlhfs_flags_in_order_and_types_ours():
    argv = ["--actor.model_name_or_path", "m", "--objective", "kl_cov", "--objective.ratio", "2e-3",
            "--actor.eps_clip_low_high", "0.2", "0.28", "--objective.within=high_entropy",
            "--objective.high_entropy.top_frac", "0.1", "--ds.packing_samples"]  # fmt: skip
    ours, rest = cli.split_argv(argv)
    assert ours.name == "kl_cov" and ours.params == {"ratio": 2e-3, "within": "high_entropy"}
    assert ours.objectives == {"high_entropy": {"top_frac": 0.1}} and not ours.help
    assert rest == ["--actor.model_name_or_path", "m", "--actor.eps_clip_low_high", "0.2", "0.28",
                    "--ds.packing_samples"]  # fmt: skip


def test_openrlhfs_lora_flags_pass_through_to_train_ppo_ray():
    lora = ["--ds.lora.rank", "16", "--ds.lora.alpha", "32", "--ds.lora.target_modules", "q_proj", "v_proj",
            "--ds.lora.dropout", "0"]  # fmt: skip
    ours, rest = cli.split_argv(["--objective", "kl_cov", *lora, "--ds.zero_stage", "3"])
    assert ours.name == "kl_cov" and rest == [*lora, "--ds.zero_stage", "3"]
    assert cli._openrlhf_notes("kl_cov", rest) == []  # nothing about LoRA defeats the objective


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--objective.ratio", "1e-3"], "error: --objective NAME is required"),
        (["--objective", "kl_cov", "--objective.ratio", "lots"], "error: --objective.ratio: expected float"),
        (["--objective", "kl_cov", "--actor.policy_loss_type", "gspo"], "error: --actor.policy_loss_type gspo"),
        (["--objective", "kl_cov", "--objective.coef"], "error: --objective.coef: expected a value"),
        (["--objective", "kl_cov", "--algo.advantage.is_correction_level", "token",
          "--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_threshold", "0.1"],
         "error: --algo.advantage.is_correction_gating tv: "),
    ],
)  # fmt: skip
def test_cli_errors_are_one_line_and_start_nothing(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cli.runpy, "run_module", lambda *a, **k: pytest.fail("train_ppo_ray must not start"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


def test_cli_notes_a_kl_cov_run_with_one_optimizer_step(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(cli.runpy, "run_module", lambda module, **k: ran.append(module))
    argv = ["--objective", "kl_cov", "--rollout.batch_size", "8", "--train.batch_size", "8"]
    assert cli.main(argv) == 0 and ran == ["openrlhf.cli.train_ppo_ray"]
    assert "KL-Cov with one optimizer step per rollout batch" in capsys.readouterr().err


def test_cli_help_lists_the_objectives_then_openrlhfs_flags(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(cli.runpy, "run_module", lambda module, **k: ran.append((module, list(sys.argv))))
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "kl_cov:" in out and "--objective.ratio" in out and "--loss." not in out
    assert ran == [("openrlhf.cli.train_ppo_ray", ["openrlhf.cli.train_ppo_ray", "--help"])]


def test_runtime_env_carries_the_hook_and_refuses_another():
    env = route.runtime_env("kl_cov", ratio=1e-3, base={"env_vars": {"A": "1"}, "working_dir": "."})
    assert env["worker_process_setup_hook"] == "entropy_openrlhf.integrations.openrlhf.setup_worker"
    assert env["env_vars"]["A"] == "1" and env["working_dir"] == "."
    assert route.SPEC_ENV in env["env_vars"]
    with pytest.raises(ValueError, match="already has a worker_process_setup_hook"):
        route.runtime_env("kl_cov", base={"worker_process_setup_hook": "other.hook"})
    with pytest.raises(ValueError, match="--objective.ratio"):
        route.runtime_env("kl_cov", ratio=-1.0)
