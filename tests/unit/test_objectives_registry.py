"""The objectives registry: what --loss.type and --loss.<name>.* come from, and the README's promise that a new
objective is one file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entropy_openrlhf.algorithms.objectives import (
    OBJECTIVES,
    LossContext,
    TokenBatch,
    get_objective,
    objective_needs_entropy,
    select_tokens,
    within_chain,
)
from entropy_openrlhf.config import ConfigError, build_parser, from_args, validate

ROOT = Path(__file__).parents[2]


def test_the_registry_holds_every_objective_with_its_flags():
    assert set(OBJECTIVES) == {"ppo", "clip_cov", "kl_cov", "high_entropy", "cispo", "gspo", "sapo", "dppo", "ce_gppo"}
    flags = set(build_parser()._option_string_actions)
    for name, obj in OBJECTIVES.items():
        for field in obj.config.__dataclass_fields__.values():
            assert f"--loss.{name}.{field.name}" in flags
            assert field.metadata["help"]  # every flag documents itself in --help
    cfg = from_args(["--loss.type", "gspo", "--loss.gspo.clip_high", "5e-4"])
    assert cfg.loss.gspo.clip_high == 5e-4 and cfg.loss.cispo.clip_low == 10.0


def test_bad_objective_settings_name_their_flag():
    with pytest.raises(ConfigError, match="--loss.type: 'nope' is not one of"):
        validate(from_args(["--loss.type", "nope"]))
    with pytest.raises(ConfigError, match="--loss.type: clip_higher is ppo with a wider upper clip"):
        validate(from_args(["--loss.type", "clip_higher"]))
    with pytest.raises(ConfigError, match="--loss.high_entropy.top_frac: 1.5 must be in"):
        validate(from_args(["--loss.type", "high_entropy", "--loss.high_entropy.top_frac", "1.5"]))
    with pytest.raises(ConfigError, match="--loss.clip_cov.bounds_unit: 'sigma': abs | std"):
        validate(from_args(["--loss.clip_cov.bounds_unit", "sigma"]))
    with pytest.raises(ConfigError, match="--loss.kl_cov.within: 'gspo'"):
        validate(from_args(["--loss.kl_cov.within", "gspo"]))
    # an objective with no knob is held by the entropy bonus alone, so it needs room for one
    validate(from_args(["--loss.type", "cispo", "--entropy.target", "0.3,0.5"]))
    with pytest.raises(ConfigError, match="--entropy.target: objective 'cispo' has no strength"):
        validate(from_args(["--loss.type", "cispo", "--entropy.target", "0.3,0.5", "--entropy.max_bonus", "0"]))
    with pytest.raises(ConfigError, match="--entropy.knob: objective 'gspo' has no knob"):
        validate(from_args(["--loss.type", "gspo", "--entropy.target", "0.3,0.5", "--entropy.knob", "coef"]))
    with pytest.raises(ConfigError, match="--loss.entropy_coef: -0.1 must be"):
        validate(from_args(["--loss.entropy_coef", "-0.1"]))
    with pytest.raises(ConfigError, match="--entropy.knob 'top_frac'"):
        validate(from_args(["--entropy.target", "0.3,0.5", "--entropy.knob", "top_frac"]))


def test_the_controller_scales_each_knob_in_the_direction_that_raises_entropy():
    kl = get_objective("kl_cov")
    params = kl.config()
    assert kl.scaled(params, 2.0).coef == 2 * params.coef and kl.scaled(params, 2.0).ratio == params.ratio
    assert kl.scaled(params, 2.0, "ratio").ratio == 2 * params.ratio
    assert kl.scaled(params, 1e9, "ratio").ratio == 1.0  # a fraction stays a fraction
    he = get_objective("high_entropy")
    assert he.scaled(he.config(), 2.0).top_frac == pytest.approx(0.1)  # fewer tokens trained: more entropy
    assert he.scaled(he.config(), 0.1).top_frac == 1.0


def random_batch(seed: int = 0, rows: int = 4, width: int = 9) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None] < torch.randint(3, width + 1, (rows, 1), generator=gen)).float()
    lp = -torch.rand(rows, width, generator=gen) * 4
    return TokenBatch(
        lp.requires_grad_(), lp.detach() + 0.1 * torch.randn(rows, width, generator=gen),
        torch.randn(rows, 1, generator=gen).expand(rows, width) * mask, mask,
        entropy=torch.rand(rows, width, generator=gen) * 3,
    )  # fmt: skip


def test_within_restricts_the_covariance_choice_to_the_high_entropy_tokens_and_logs_the_overlap():
    cfg = from_args(["--loss.kl_cov.ratio", "0.2", "--loss.kl_cov.within", "high_entropy"])
    assert objective_needs_entropy("kl_cov", cfg.loss) and not objective_needs_entropy("cispo", cfg.loss)
    batch = random_batch()
    free, _ = select_tokens("kl_cov", get_objective("kl_cov").config(ratio=0.2), cfg.loss, batch, LossContext())
    forking, _ = select_tokens("high_entropy", cfg.loss.high_entropy, cfg.loss, batch, LossContext())
    chosen, metrics = select_tokens("kl_cov", cfg.loss.kl_cov, cfg.loss, batch, LossContext())
    assert int(chosen.sum()) == int(free.sum())  # same quota
    assert not (chosen & ~forking).any()  # only forking tokens
    overlap = float((free & forking).sum()) / float(free.sum())
    assert metrics["select/overlap_cov_entropy"] == pytest.approx(overlap)
    assert 0 < overlap < 1  # this batch has both kinds, so the metric is not trivially 0 or 1
    assert metrics["select/within_frac"] == pytest.approx(float(forking.sum()) / float(batch.mask.sum()))


def test_a_new_objective_is_one_file_as_the_readme_shows(tmp_path):
    """docs/guides/extending.md's example, dropped into a copy of the package's objectives folder, becomes --loss.type
    reinforce with its --loss.reinforce.scale flag, and the registry runs it."""
    readme = (ROOT / "docs" / "guides" / "extending.md").read_text()
    code = re.search(r"```python\n(# entropy_openrlhf/algorithms/objectives/reinforce\.py\n.*?)```", readme, re.S)
    assert code, "docs/guides/extending.md's 'Add an objective' example is missing"
    package = tmp_path / "entropy_openrlhf"
    shutil.copytree(ROOT / "entropy_openrlhf", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "algorithms" / "objectives" / "reinforce.py").write_text(code.group(1))
    check = """
import torch
from entropy_openrlhf.algorithms.objectives import LossContext, TokenBatch, get_objective
from entropy_openrlhf.config import from_args, validate
cfg = from_args(["--loss.type", "reinforce", "--loss.reinforce.scale", "0.5"])
validate(cfg)
lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
batch = TokenBatch(lp, lp.detach(), torch.tensor([[2.0, 2.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
out = get_objective("reinforce").loss(batch, cfg.loss.reinforce, LossContext())
out.loss.backward()
weighted = TokenBatch(lp, lp.detach(), batch.advantages, batch.mask, is_weights=torch.tensor([[0.5, 0.0, 9.0]]))
print(float(get_objective("reinforce").loss(weighted, cfg.loss.reinforce, LossContext()).loss))
print(float(out.loss), lp.grad.tolist())
"""
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    *_, with_weights, last = run.stdout.strip().split("\n")
    loss, grad = last.split(" ", 1)
    # -0.5 * 2 * (-1 - 2) / 2 tokens = 1.5; d/dlp = -0.5 * 2 / 2 on the valid tokens, 0 on padding
    assert float(loss) == pytest.approx(1.5)
    # the off-policy weights multiply each token's loss (padding's weight never enters): -0.5 * 2 * -1 * 0.5 / 2
    assert float(with_weights) == pytest.approx(0.25)
    assert [abs(g) for g in json.loads(grad)[0]] == [0.5, 0.5, 0.0] and json.loads(grad)[0][0] < 0


def test_within_is_one_rule_for_the_config_and_the_openrlhf_adapter():
    from entropy_openrlhf.integrations.openrlhf import build_settings

    # a chain through two selectors runs (select_tokens recurses); a loop or a non-selector is refused by both
    cfg = from_args(["--loss.kl_cov.within", "clip_cov", "--loss.clip_cov.within", "high_entropy"])
    validate(cfg)
    assert within_chain("kl_cov", cfg.loss) == ["kl_cov", "clip_cov", "high_entropy"]
    looped = ["--loss.kl_cov.within", "clip_cov", "--loss.clip_cov.within", "kl_cov"]
    with pytest.raises(ConfigError, match="--loss.kl_cov.within: 'kl_cov': must name another selecting objective"):
        validate(from_args(looped))
    with pytest.raises(ValueError, match="--objective.within 'kl_cov': must name another selecting objective"):
        build_settings("kl_cov", {"within": "clip_cov"}, {"clip_cov": {"within": "kl_cov"}})
    _, loss_cfg = build_settings("kl_cov", {"within": "clip_cov"}, {"clip_cov": {"within": "high_entropy"}})
    assert within_chain("kl_cov", loss_cfg) == ["kl_cov", "clip_cov", "high_entropy"]


def test_kl_cov_ppo_clip_flag_reaches_the_loss_with_the_run_s_clip():
    from entropy_openrlhf.algorithms.losses import kl_cov_loss

    cfg = from_args(["--loss.kl_cov.ppo_clip", "true", "--loss.kl_cov.ratio", "0.2"])
    validate(cfg)
    base = random_batch(seed=3)
    noise = torch.randn(base.log_probs.shape, generator=torch.Generator().manual_seed(1))
    batch = TokenBatch(base.log_probs, base.log_probs.detach() + 0.6 * noise, base.advantages, base.mask)  # clip binds
    ctx = LossContext(clip_low=0.2, clip_high=0.28)
    got = get_objective("kl_cov").loss(batch, cfg.loss.kl_cov, ctx)
    args = (batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask)
    want = kl_cov_loss(*args, ratio=0.2, coef=cfg.loss.kl_cov.coef, ppo_clip=(0.2, 0.28))
    paper = kl_cov_loss(*args, ratio=0.2, coef=cfg.loss.kl_cov.coef)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    assert float(got.loss) != pytest.approx(float(paper.loss), rel=1e-4)  # the flag changed something here
