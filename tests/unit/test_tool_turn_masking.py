"""A tool turn changes nothing the policy is trained or measured on: tokens with `response_mask` 0 inserted into a
response leave the loss, its gradient on the policy's tokens, the covariance selection (Clip-Cov's and KL-Cov's, per
micro-batch and pooled over a mini-batch) and the entropy metrics exactly as they were, whatever values those tokens
carry; through a whole policy step, the values a tool turn's tokens hold (their rollout log-probs, 0.0 by
python_tool's convention, or anything else) change no metric and no weight. The per-turn entropy metrics
(`entropy/turn*/seq_mean`, `entropy/post_tool_token_mean`) are checked against a hand computation.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.algorithms.metrics import entropy_stats, turn_entropy_stats
from entropy_openrlhf.algorithms.objectives import OBJECTIVES, LossContext, TokenBatch, run_objective, select_tokens
from entropy_openrlhf.algorithms.selection import pooled_selection
from entropy_openrlhf.config import from_args
from entropy_openrlhf.models.tiny import make_tiny_model
from tests.unit.policy_harness import load_model, make_actor, model_log_probs, one_thread, step_config, weights

LENGTHS = [9, 4, 7, 12, 6, 10]  # policy tokens per row
TOOL = {0: (3, 4), 2: (5, 2), 3: (4, 6), 5: (2, 3)}  # row: (after how many policy tokens, how many tool tokens)
SEED = 11
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32 rounding of sums taken in another order
# every selector at ratios that pick several tokens of this small batch
FLAGS = ["--loss.clip_cov.ratio", "0.2", "--loss.kl_cov.ratio", "0.2", "--loss.high_entropy.top_frac", "0.3"]


def policy_values(seed: int = SEED) -> dict[str, list[torch.Tensor]]:
    """Per row, the policy tokens' current and old log-probs, advantage, entropy and IS weight."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("lp", "old", "adv", "ent", "w")}
    for n in LENGTHS:
        lp = -torch.rand(n, generator=gen) * 3
        out["lp"].append(lp)
        out["old"].append(lp + 0.5 * torch.randn(n, generator=gen))
        out["adv"].append(torch.randn(1, generator=gen).expand(n).clone())
        out["ent"].append(torch.rand(n, generator=gen) * 3)
        out["w"].append(0.5 + torch.rand(n, generator=gen))
    return out


def grid(values: dict[str, list[torch.Tensor]], with_tools: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(B, L) tensors of the rows, with each row's tool span inserted (mask 0, wild values) when `with_tools`, and
    where each policy token landed ((B, L) bool)."""
    rows: dict[str, list[list[float]]] = {k: [] for k in (*values, "mask", "turns", "tool")}
    places = []
    for r, n in enumerate(LENGTHS):
        after, count = TOOL.get(r, (n, 0)) if with_tools else (n, 0)
        for k in values:
            v = values[k][r].tolist()
            wild = {"lp": -30.0, "old": 4.0, "adv": 50.0, "ent": 90.0, "w": 100.0}[k]
            rows[k].append(v[:after] + [wild] * count + v[after:])
        rows["mask"].append([1.0] * after + [0.0] * count + [1.0] * (n - after))
        rows["turns"].append([1] * after + [0] * count + [2 if count else 1] * (n - after))
        rows["tool"].append([0] * after + [1] * count + [0] * (n - after))
        places.append([True] * after + [False] * count + [True] * (n - after))
    width = max(len(m) for m in rows["mask"])

    def pad(row: list, fill) -> list:
        return row + [fill] * (width - len(row))

    out = {k: torch.tensor([pad(row, 0.0) for row in v]) for k, v in rows.items()}
    out["turns"] = out["turns"].long()
    return out, torch.tensor([pad(p, False) for p in places])


def policy_part(t: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """The policy tokens' values, in order: what the two grids must agree on."""
    return t[places]


def one_call(name: str, g: dict[str, torch.Tensor]):
    cfg = from_args(FLAGS, {"loss.type": name})
    lp = g["lp"].clone().requires_grad_()
    ctx = LossContext(clip_low=0.2, clip_high=0.28, generator=torch.Generator().manual_seed(SEED))
    out, metrics = run_objective(
        name, getattr(cfg.loss, name), cfg.loss, ctx, lp, g["old"], g["adv"], g["mask"], entropy=g["ent"],
        is_weights=g["w"],
    )  # fmt: skip
    out.loss.backward()
    return out, metrics, lp.grad


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_masked_tool_tokens_change_no_loss_gradient_selection_or_metric(name):
    values = policy_values()
    (plain, p_places), (tooled, t_places) = grid(values, False), grid(values, True)
    out_p, sel_p, grad_p = one_call(name, plain)
    out_t, sel_t, grad_t = one_call(name, tooled)
    # the losses reduce in fp32 over grids of other widths, in another order: equal to fp32 rounding (TOL), while
    # the wild values, were they read, would move the loss far beyond it (the control below)
    torch.testing.assert_close(out_t.loss, out_p.loss, **TOL)
    torch.testing.assert_close(policy_part(grad_t, t_places), policy_part(grad_p, p_places), **TOL)
    assert not grad_t[~t_places].any()  # no gradient reaches a tool token
    if OBJECTIVES[name].select is not None:  # the selection acts here: its equality says something
        assert out_p.selected[p_places].any()
    if out_p.selected is not None:
        assert torch.equal(policy_part(out_t.selected, t_places), policy_part(out_p.selected, p_places))
        assert not out_t.selected[~t_places].any()
    assert out_t.metrics.keys() == out_p.metrics.keys() and sel_t.keys() == sel_p.keys()
    for k in out_p.metrics:
        assert out_t.metrics[k] == pytest.approx(out_p.metrics[k], rel=TOL["rtol"], abs=TOL["atol"]), k
    for k in sel_p:
        assert sel_t[k] == pytest.approx(sel_p[k], rel=TOL["rtol"], abs=TOL["atol"]), k
    # the control: the same grid with the tool tokens counted gives another loss (so the equality says something)
    counted = dict(tooled, mask=tooled["mask"] + tooled["tool"])
    assert abs(float(one_call(name, counted)[0].loss.detach() - out_p.loss.detach())) > 100 * TOL["atol"]


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "high_entropy"])
def test_the_pooled_selection_over_a_mini_batch_ignores_tool_tokens(name):
    """--loss.scope global: the selection pooled over micro-batches (rows 0-2 and 3-5 here) is the same."""
    values = policy_values()
    cfg = from_args(FLAGS, {"loss.type": name})

    def chosen(with_tools: bool):
        g, places = grid(values, with_tools)
        parts = [slice(0, 3), slice(3, 6)]
        batches = [TokenBatch(g["lp"][p], g["old"][p], g["adv"][p], g["mask"][p], entropy=g["ent"][p]) for p in parts]

        def select(tokens, means):
            ctx = LossContext(cov_means=means, generator=torch.Generator().manual_seed(SEED))
            return select_tokens(name, getattr(cfg.loss, name), cfg.loss, tokens, ctx)

        result = pooled_selection(batches, select, with_entropy=True)
        return torch.cat(result.masks), places, result

    sel_p, p_places, res_p = chosen(False)
    sel_t, t_places, res_t = chosen(True)
    assert sel_p[p_places].any() and not sel_t[~t_places].any()
    assert torch.equal(sel_t[t_places], sel_p[p_places])
    assert res_t.means == pytest.approx(res_p.means) and res_t.total == res_p.total


def test_entropy_metrics_ignore_tool_tokens_and_split_by_turn():
    values = policy_values()
    plain, _ = grid(values, False)
    tooled, _ = grid(values, True)
    assert entropy_stats(tooled["ent"], tooled["mask"]) == pytest.approx(entropy_stats(plain["ent"], plain["mask"]))
    k = 3
    stats = turn_entropy_stats(tooled["ent"], tooled["mask"], tooled["turns"], k)
    # by hand: per row, the mean of each turn's entropies; the first k policy tokens after each tool span
    turn1, turn2, post = [], [], []
    for r, n in enumerate(LENGTHS):
        e = values["ent"][r]
        after = TOOL[r][0] if r in TOOL else n
        turn1.append(float(e[:after].mean()))
        if r in TOOL:
            turn2.append(float(e[after:].mean()))
            post += e[after : after + k].tolist()
    assert stats["entropy/turn1/seq_mean"] == pytest.approx(sum(turn1) / len(turn1))
    assert stats["entropy/turn2/seq_mean"] == pytest.approx(sum(turn2) / len(turn2))
    assert stats["entropy/post_tool_token_mean"] == pytest.approx(sum(post) / len(post))
    assert "entropy/turn3+/seq_mean" not in stats  # no third turn here: absent, not 0
    # a third turn, and a token of it masked out (--loss.mask_truncated's kind): only valid tokens count
    turns, mask = tooled["turns"].clone(), tooled["mask"].clone()
    turns[3, -2:], mask[3, -1] = 3, 0.0
    third = turn_entropy_stats(tooled["ent"], mask, turns, k)["entropy/turn3+/seq_mean"]
    assert third == pytest.approx(float(tooled["ent"][3, -2]))
    assert turn_entropy_stats(plain["ent"], plain["mask"], torch.ones_like(plain["turns"]), k) == {
        "entropy/turn1/seq_mean": pytest.approx(entropy_stats(plain["ent"], plain["mask"])["seq_mean"])
    }


# ------------------------------------------------------------------ through a policy step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def tool_samples(model, rollout_fill: float) -> list[TrainSample]:
    """8 responses, half with a tool span of 3 tokens in the middle (mask 0, turn 0), their rollout log-probs there
    `rollout_fill`; the policy's tokens keep rollout log-probs near the model's own."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        prompt = [1, 5 + i // 4, 6, 7]
        n = 6 + i % 3
        response = torch.randint(3, 300, (n,), generator=gen).tolist()
        own = model_log_probs(model, prompt, response)
        rollout = [x + 0.2 * float(torch.randn(1, generator=gen)) for x in own]
        mask, turns = [1] * n, [1] * n
        if i % 2:
            for j in (2, 3, 4):
                mask[j], turns[j], rollout[j] = 0, 0, rollout_fill
            turns[5:] = [2] * (n - 5)
        advantage = float(torch.randn(1, generator=gen))
        out.append(TrainSample(prompt, response, advantage, rollout, response_mask=mask, token_turns=turns))
    return out


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_a_policy_step_does_not_read_what_tool_tokens_hold(tiny, loss):
    """The same episodes, their tool tokens' rollout log-probs 0.0 (python_tool's fill) or -40: the step's metrics
    and the weights after it are identical; the step logs the per-turn entropy metrics (their arithmetic is checked
    by hand above)."""
    flags = FLAGS
    results = []
    for fill in (0.0, -40.0):
        cfg = step_config(*flags, loss=loss)
        model = load_model(tiny)
        with one_thread():
            actor = make_actor(cfg, model)
            metrics = actor.train_step(tool_samples(model, fill), 0)
        results.append((metrics, weights(model)))
    (first, w_first), (second, w_second) = results
    assert first.keys() == second.keys()
    for k in first:
        if k.startswith("time/"):
            continue
        assert second[k] == pytest.approx(first[k], rel=1e-6, abs=1e-8), k
    for name in w_first:
        torch.testing.assert_close(w_second[name], w_first[name], rtol=0, atol=0)
    assert {"entropy/turn1/seq_mean", "entropy/turn2/seq_mean", "entropy/post_tool_token_mean"} <= first.keys()
    assert "entropy/turn3+/seq_mean" not in first


def test_single_turn_steps_log_no_per_turn_entropy(tiny):
    cfg = step_config(loss="ppo")
    model = load_model(tiny)
    samples = [dataclasses.replace(s, token_turns=None, response_mask=None) for s in tool_samples(model, 0.0)]
    with one_thread():
        metrics = make_actor(cfg, copy.deepcopy(model)).train_step(samples, 0)
    assert not any(k.startswith("entropy/turn") or k == "entropy/post_tool_token_mean" for k in metrics)
