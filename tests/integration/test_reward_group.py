"""The reward actor group on a real local Ray: order, fault isolation (exception, hang, worker death, a worker stuck
beyond signals), the OpenRLHF reward_func form and the countdown example."""

import json
import logging
import textwrap
import time
from pathlib import Path

import pytest

from entropy_openrlhf.samples import Sample

pytestmark = pytest.mark.integration

# Every call leaves a file named after the response in metadata["calls_dir"], so tests can count calls across
# worker processes and restarts. The response says how to misbehave.
FLAKY = textwrap.dedent(
    """
    import os, signal, time, uuid

    def verify(response, label, *, prompt="", metadata=None):
        calls = metadata["calls_dir"]
        open(os.path.join(calls, f"{response}.{uuid.uuid4().hex}"), "w").close()
        if response == "raise":
            raise RuntimeError("boom on purpose")
        if response == "hang":
            time.sleep(3600)
        if response == "die-once" and not os.path.exists(os.path.join(calls, "died")):
            open(os.path.join(calls, "died"), "w").close()
            os._exit(3)
        if response == "die-always":
            os._exit(4)
        if response == "stuck":
            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # no deadline signal reaches it any more
            time.sleep(3600)
        return {"reward": float(response == label), "acc": response == label, "format_ok": True, "tag": response}
    """
)

OPENRLHF_FILE = textwrap.dedent(
    """
    import torch

    def reward_func(queries, prompts, labels, **kwargs):
        rewards = torch.tensor([1.0 if q.endswith(l) else 0.0 for q, l in zip(queries, labels)])
        return {
            "rewards": rewards,
            "scores": rewards,
            "extra_logs": {"query_len": torch.tensor([float(len(q)) for q in queries])},
        }
    """
)


def make_samples(responses, labels, calls_dir=None, prompt="Q: "):
    meta = {"calls_dir": str(calls_dir)} if calls_dir else {}
    return [
        Sample(
            prompt_index=i,
            prompt=prompt,
            prompt_token_ids=[1],
            response=response,
            response_token_ids=[2],
            rollout_log_probs=[-0.1],
            label=label,
            policy_version=0,
            metadata=dict(meta),
        )
        for i, (response, label) in enumerate(zip(responses, labels))
    ]


def calls(calls_dir: Path, response: str) -> int:
    return sum(1 for p in calls_dir.iterdir() if p.name.rsplit(".", 1)[0] == response)


@pytest.fixture()
def flaky_spec(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    return f"{path}:verify"


@pytest.fixture()
def calls_dir(tmp_path):
    d = tmp_path / "calls"
    d.mkdir()
    return d


def test_math_order_preserved_across_two_workers(ray_cluster):
    from entropy_openrlhf.actors.reward import RewardGroup

    group = RewardGroup("math", num_workers=2, timeout_s=5.0)
    try:
        # correct iff i is even; each response is unique, so any reordering shows
        responses = [f"\\boxed{{{i if i % 2 == 0 else i + 100}}}" for i in range(20)] + ["no answer here"]
        labels = [str(i) for i in range(20)] + ["7"]
        samples = make_samples(responses, labels)
        out, metrics = group.score(samples)
        assert [s.prompt_index for s in out] == list(range(21))
        assert [s.reward for s in out] == [1.0 if i % 2 == 0 else 0.0 for i in range(20)] + [0.0]
        assert [s.reward_info["pred"] for s in out[:20]] == [r[7:-1] for r in responses[:20]]
        assert out[-1].format_ok is False and all(s.format_ok for s in out[:20])
        assert metrics["reward/mean"] == pytest.approx(10 / 21)
        assert metrics["reward/acc"] == pytest.approx(10 / 21)
        assert metrics["reward/format_rate"] == pytest.approx(20 / 21)
        assert metrics["reward/std"] > 0
        assert metrics["reward/timeouts"] == 0 and metrics["reward/errors"] == 0
        assert 0 < metrics["reward/seconds_per_sample"] < 5
    finally:
        group.shutdown()


def test_exception_and_hang_score_zero_and_the_worker_carries_on(ray_cluster, flaky_spec, calls_dir, caplog):
    from entropy_openrlhf.actors.reward import RewardGroup

    group = RewardGroup(flaky_spec, num_workers=2, timeout_s=1.0)
    try:
        responses = ["a", "raise", "b", "hang", "c", "raise", "d"]
        labels = ["a", "x", "b", "x", "c", "x", "zz"]
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="entropy_openrlhf.actors.reward"):
            out, metrics = group.score(make_samples(responses, labels, calls_dir))
        # the hang sleeps an hour: coming back at all shows the deadline cut it (about 1 s when quiet; the bound
        # leaves room for a loaded machine)
        assert time.monotonic() - start < 60
        assert [s.response for s in out] == responses
        assert [s.reward for s in out] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
        assert out[1].reward_info["error"] == "RuntimeError: boom on purpose"
        assert out[3].reward_info["timed_out"] is True and out[3].reward_info["error"] is None
        assert out[0].reward_info == {"tag": "a", "timed_out": False, "error": None}
        assert metrics["reward/errors"] == 2 and metrics["reward/timeouts"] == 1
        assert metrics["reward/scored_frac"] == pytest.approx(4 / 7)  # the two raises and the hang were not scored
        assert "first error: RuntimeError: boom on purpose" in caplog.text
        # the hang was cut inside the worker: no restart, each sample checked exactly once
        assert all(calls(calls_dir, r) == responses.count(r) for r in set(responses))
        out, metrics = group.score(make_samples(["e"], ["e"], calls_dir))  # the same workers still serve
        assert out[0].reward == 1.0 and metrics["reward/errors"] == 0
        assert metrics["reward/scored_frac"] == 1.0
    finally:
        group.shutdown()


def test_worker_death_restarts_and_retries_without_loss_or_duplicates(ray_cluster, flaky_spec, calls_dir):
    from entropy_openrlhf.actors.reward import RewardGroup

    group = RewardGroup(flaky_spec, num_workers=2, timeout_s=5.0)
    try:
        responses = ["a", "die-once", "b", "c", "d", "e"]  # worker 0 gets a, die-once, b
        out, metrics = group.score(make_samples(responses, ["a", "die-once", "b", "c", "d", "x"], calls_dir))
        assert [s.response for s in out] == responses
        assert [s.reward for s in out] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
        assert metrics["reward/errors"] == 0
        # one result per sample (above), but the verifier ran twice on the dead worker's batch: the retry starts it
        # again on the restarted worker from its first sample. The other batch ran once.
        assert (calls_dir / "died").exists()
        assert [calls(calls_dir, r) for r in responses] == [2, 2, 1, 1, 1, 1]
    finally:
        group.shutdown()


def test_a_sample_that_always_kills_the_worker_is_isolated(ray_cluster, flaky_spec, calls_dir):
    from entropy_openrlhf.actors.reward import RewardGroup

    group = RewardGroup(flaky_spec, num_workers=2, timeout_s=5.0)
    try:
        responses = ["a", "die-always", "b", "c"]
        out, metrics = group.score(make_samples(responses, responses, calls_dir))
        assert [s.reward for s in out] == [1.0, 0.0, 1.0, 1.0]
        assert out[1].reward_info["error"].startswith("the verifier worker failed twice on it")
        assert metrics["reward/errors"] == 1
        # batch of 2, its retry, then one task per sample: the culprit twice more, its neighbour once more
        assert calls(calls_dir, "die-always") == 4 and calls(calls_dir, "a") == 3
    finally:
        group.shutdown()


def test_a_worker_stuck_beyond_signals_is_restarted(ray_cluster, flaky_spec, calls_dir):
    from entropy_openrlhf.actors.reward import RewardGroup

    group = RewardGroup(flaky_spec, num_workers=2, timeout_s=0.5, stuck_grace_s=2.0)
    try:
        responses = ["a", "stuck", "b", "c"]
        start = time.monotonic()
        out, metrics = group.score(make_samples(responses, responses, calls_dir))
        # the stuck sample sleeps an hour: coming back at all shows the group killed it. Quiet, this takes two
        # budgets (4 s for the batch, 3 s for the sample alone) and two worker restarts; the bound leaves room for a
        # loaded machine, where a restart takes several times longer
        assert time.monotonic() - start < 180
        assert [s.reward for s in out] == [1.0, 0.0, 1.0, 1.0]
        assert out[1].reward_info["timed_out"] is True
        assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 0
        # the stuck batch [a, stuck] ran twice (as a batch, then one task per sample); the other batch once
        assert [calls(calls_dir, r) for r in responses] == [2, 2, 1, 1]
        out, _ = group.score(make_samples(["d", "e"], ["d", "e"], calls_dir))  # both workers serve again
        assert [s.reward for s in out] == [1.0, 1.0]
    finally:
        group.shutdown()


def test_openrlhf_reward_file_with_extra_logs(ray_cluster, tmp_path):
    from entropy_openrlhf.actors.reward import RewardGroup

    path = tmp_path / "my_reward.py"
    path.write_text(OPENRLHF_FILE)
    group = RewardGroup(str(path), num_workers=2, timeout_s=5.0)
    try:
        out, metrics = group.score(make_samples(["42", "41", "7"], ["42", "42", "7"], prompt="Q: "))
        assert [s.reward for s in out] == [1.0, 0.0, 1.0]
        assert [s.acc for s in out] == [True, False, True]
        assert out[0].reward_info["query_len"] == len("Q: 42")
        assert metrics["reward/query_len"] == pytest.approx((5 + 5 + 4) / 3)  # "Q: 42", "Q: 41", "Q: 7"
        assert metrics["reward/mean"] == pytest.approx(2 / 3)
    finally:
        group.shutdown()


def test_openrlhf_file_gets_queries_decoded_with_their_special_tokens(ray_cluster, tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from entropy_openrlhf.actors.reward import RewardGroup

    path = tmp_path / "rm.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n    return [float(q.endswith('<|im_end|>')) for q in queries]\n"
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    samples = make_samples(["The answer is 5", "The answer"], ["5", "5"], prompt=prompt)
    for s, stopped in zip(samples, (True, False)):  # token ids as the engine gives them: the first stopped at eos
        s.prompt_token_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        s.response_token_ids = (
            tokenizer(s.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * stopped
        )
    group = RewardGroup(str(path), num_workers=1, timeout_s=5.0, tokenizer_path=tiny_model)
    try:
        out, _ = group.score(samples)
        assert [s.reward for s in out] == [1.0, 0.0]  # only the response that stopped at eos ends with its token
    finally:
        group.shutdown()


def test_countdown_example_plugs_in(ray_cluster):
    from entropy_openrlhf.actors.reward import RewardGroup
    from rewards import load_verifier

    spec = "rewards.examples.countdown:countdown_verifier"
    assert load_verifier(spec).batched is False  # the pipeline's early check of --reward.verifier
    label = json.dumps({"target": 60, "numbers": [3, 5, 25]})
    responses = [
        "<think>25-5=20, 20*3=60</think><answer>(25 - 5) * 3</answer>",
        "<answer>25 * 3 - 5</answer>",  # well-formed, 70
        "<answer>(25 - 5) * 3 * 1</answer>",  # uses a number it was not given
        "I give up",
    ]
    group = RewardGroup(spec, num_workers=2, timeout_s=5.0)
    try:
        out, metrics = group.score(make_samples(responses, [label] * 4))
        assert [s.reward for s in out] == [1.0, 0.1, 0.1, 0.0]
        assert [s.acc for s in out] == [True, False, False, False]
        assert [s.format_ok for s in out] == [True, True, True, False]
        assert out[0].reward_info["equation"] == "(25 - 5) * 3"
        assert metrics["reward/acc"] == pytest.approx(0.25)
    finally:
        group.shutdown()


def test_load_error_is_raised_in_the_driver(ray_cluster, tmp_path):
    from entropy_openrlhf.actors.reward import RewardGroup
    from rewards import VerifierLoadError

    with pytest.raises(VerifierLoadError, match="has no function 'nope'"):
        RewardGroup("rewards.math:nope", num_workers=1)


def test_a_verifier_that_loads_in_the_driver_but_not_in_a_worker(ray_cluster, tmp_path):
    from entropy_openrlhf.actors.reward import RewardGroup
    from rewards import VerifierLoadError

    path = tmp_path / "driver_only.py"
    path.write_text(
        "import ray\n"
        "if ray.is_initialized() and ray.get_runtime_context().get_actor_id():\n"
        "    raise ImportError('a dependency missing on the workers')\n"
        "def verify(response, label, **kw):\n"
        "    return 1.0\n"
    )
    with pytest.raises(VerifierLoadError, match="does not load in a worker: .*a dependency missing on the workers"):
        RewardGroup(f"{path}:verify", num_workers=1)
