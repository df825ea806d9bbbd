"""The rollout seam: the trainer asks `--rollout.function` for its groups of samples, and checks what it gets."""

import re
import threading
from pathlib import Path

import pytest

from entropy_openrlhf.config import ConfigError, from_args, validate
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.rollouts import ROLLOUTS, RolloutRequest, check_groups, get_rollout, register_rollout
from entropy_openrlhf.samples import PromptItem, Sample

CALLS: list[RolloutRequest] = []


def tool_turn(engines, request: RolloutRequest) -> list[list[Sample]]:
    """A trivial two-part rollout, no engine: the policy's tokens [5, 6], a tool's output [7] it did not choose
    (mask 0), then the policy's [8]. It records each request so the test can see what the trainer asked."""
    CALLS.append(request)
    return [
        [
            Sample(
                p.index, p.prompt, [1, 2], f"answer {j}", [5, 6, 7, 8], [-0.5, -0.25, 0.0, -1.0], p.label,
                request.policy_version, messages=p.messages, response_mask=[1, 1, 0, 1],
            )
            for j in range(request.n)
        ]
        for p in request.prompts
    ]  # fmt: skip


class Reward:
    """Scores a sample 1 when its response ends in 1 (half of each group here), as the reward group would."""

    def score(self, samples: list[Sample]):
        for s in samples:
            s.reward = float(s.response.endswith("1"))
        return samples, {"reward/mean": sum(s.reward for s in samples) / len(samples)}


class Reference:
    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        return [[-2.0] * len(r) for r in response_ids]


class Sync:
    engine_lock = threading.Lock()
    engine_version = 3

    def make_current(self) -> float:
        return 0.0


class Engines:
    """Never called by tool_turn: a default rollout would reach the engines through it."""

    restarts = 0

    def generate(self, *args, **kwargs):
        raise AssertionError("the engines were called instead of the rollout function")


def trainer_with(function: str, n: int = 2, *flags: str) -> Trainer:
    sizes = ["--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", str(n)]
    cfg = from_args(["--rollout.function", function, "--data.shuffle", "false", *sizes, *flags])
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    items = [PromptItem(i, f"<prompt {i}>", "4", messages=messages) for i in range(4)]
    trainer = Trainer(cfg, "unused", items, [])
    trainer.rollout, trainer.reward, trainer.reference, trainer.sync = Engines(), Reward(), Reference(), Sync()
    return trainer


def test_the_trainer_takes_its_groups_from_the_rollout_function_named_by_the_flag():
    CALLS.clear()
    trainer = trainer_with(f"{__name__}:tool_turn")
    batch = trainer._make_batch(0)
    (request,) = CALLS
    assert [p.index for p in request.prompts] == [0, 1] and request.n == 2 and request.policy_version == 3
    assert [[s.prompt_index for s in g] for g in batch.groups] == [[0, 0], [1, 1]]
    sample = batch.groups[0][0]
    assert sample.response_mask == [1, 1, 0, 1] and sample.messages == [{"role": "user", "content": "What is 2 + 2?"}]
    assert sample.ref_log_probs == [-2.0] * 4 and "ref_log_probs" not in sample.metadata  # a field, not metadata
    assert [s.reward for g in batch.groups for s in g] == [0.0, 1.0, 0.0, 1.0]  # scored after the function
    train = trainer._train_samples(batch)
    assert train[0].ref_log_probs == [-2.0] * 4 and train[0].rollout_log_probs == [-0.5, -0.25, 0.0, -1.0]


def test_the_policy_is_given_each_sample_s_loss_mask():
    trainer = trainer_with(f"{__name__}:tool_turn")
    batch = trainer._make_batch(0)
    batch.groups[1][0].finish_reason = "length"
    assert [t.response_mask for t in trainer._train_samples(batch)] == [[1, 1, 0, 1]] * 4  # the tool's token out
    cut = trainer_with(f"{__name__}:tool_turn", 2, "--loss.mask_truncated", "true")
    batch = cut._make_batch(0)
    batch.groups[1][0].finish_reason = "length"  # cut at the limit: every token leaves the loss
    masks = [t.response_mask for t in cut._train_samples(batch)]
    assert masks == [[1, 1, 0, 1], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1]]


def test_the_overlong_penalty_is_added_in_training_and_logged():
    # tool_turn's responses are 4 tokens: at a limit of 4 with a buffer of 2 they sit at the limit, penalty -0.5
    flags = ("--rollout.max_new_tokens", "4", "--reward.overlong_buffer_len", "2", "--reward.overlong_penalty_factor",
             "0.5")  # fmt: skip
    batch = trainer_with(f"{__name__}:tool_turn", 2, *flags)._make_batch(0)
    assert [s.reward for g in batch.groups for s in g] == [-0.5, 0.5, -0.5, 0.5]
    assert batch.groups[0][0].reward_info["overlong_penalty"] == -0.5
    assert batch.metrics["reward/overlong_penalty_mean"] == -0.5
    off = trainer_with(f"{__name__}:tool_turn")._make_batch(0)
    assert "reward/overlong_penalty_mean" not in off.metrics


def test_a_rollout_function_returning_malformed_groups_is_named():
    trainer = trainer_with(f"{__name__}:tool_turn", n=3)  # asks 3 per prompt; tool_turn honours n, so break it
    trainer.rollout_fn = lambda engines, request: tool_turn(engines, request)[:1]
    with pytest.raises(ValueError, match=rf"rollout function {__name__}:tool_turn: 1 groups for 2 prompts"):
        trainer._make_batch(0)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: setattr(s, "response_mask", [1, 1]), "sample 0: response_mask has 2 values for 4 response tokens"),
        (lambda s: setattr(s, "rollout_log_probs", [0.0]), "sample 0: rollout_log_probs has 1 values for 4"),
        (lambda s: setattr(s, "ref_log_probs", [0.0] * 5), "sample 0: ref_log_probs has 5 values for 4"),
        (lambda s: setattr(s, "response_mask", [1, 2, 0, 1]), "sample 0: response_mask holds values other than"),
        (lambda s: setattr(s, "prompt_index", 9), "prompt 0, sample 0: prompt_index is 9"),
    ],
)
def test_check_groups_names_the_prompt_sample_and_field(change, needle):
    items = [PromptItem(0, "p", "4")]
    request = RolloutRequest(items, 2, 1.0, 1.0, 8, seed=1, policy_version=0)
    groups = tool_turn(None, request)
    check_groups(groups, request, "mine")  # well-formed as built
    change(groups[0][0])
    with pytest.raises(ValueError, match="rollout function mine: prompt 0, " + needle.removeprefix("prompt 0, ")):
        check_groups(groups, request, "mine")
    with pytest.raises(ValueError, match="prompt 0 got 1 samples, not 2"):
        check_groups([groups[0][1:]], request, "mine")


def test_single_turn_is_the_default_and_groups_the_engines_samples_by_prompt():
    assert from_args([]).rollout.function == "single_turn"

    class Recording:
        def generate(self, prompts, *, n, policy_version, **sampling):
            self.sampling = sampling
            return [Sample(p.index, p.prompt, [1], f"r{j}", [2, 3], [-1.0, -1.0], p.label, policy_version)
                    for p in prompts for j in range(n)]  # fmt: skip

    engines = Recording()
    request = RolloutRequest([PromptItem(4, "a", "1"), PromptItem(7, "b", "2")], 3, 0.7, 0.9, 16, 11, 2)
    groups = get_rollout("single_turn")(engines, request)
    assert [[s.prompt_index for s in g] for g in groups] == [[4, 4, 4], [7, 7, 7]]
    assert groups[0][0].response_mask == [1, 1]  # every token the policy's: filled on construction
    assert engines.sampling == dict(temperature=0.7, top_p=0.9, max_new_tokens=16, seed=11)


def test_unknown_and_unloadable_rollout_functions_are_refused_by_the_config():
    for value, needle in (("single_trun", "did you mean single_turn"), ("no.such.module:fn", "cannot load it")):
        with pytest.raises(ConfigError, match="--rollout.function"):
            validate(from_args(["--rollout.function", value]))
        with pytest.raises(ValueError, match=needle):
            get_rollout(value)


def test_registering_a_name_twice_is_refused():
    register_rollout("test_only_once")(tool_turn)
    try:
        with pytest.raises(ValueError, match="registered twice"):
            register_rollout("test_only_once")(tool_turn)
        assert get_rollout("test_only_once") is tool_turn
    finally:
        del ROLLOUTS["test_only_once"]


def test_the_documented_rollout_function_runs_as_the_flag_names_it(tmp_path, monkeypatch):
    """docs/guides/extending.md's example, saved as my_rollouts.py, is what --rollout.function my_rollouts:once
    loads."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "extending.md").read_text()
    code = re.search(r"```python\n(# my_rollouts\.py.*?)```", docs, re.S)
    assert code, "docs/guides/extending.md's rollout function example is missing"
    (tmp_path / "my_rollouts.py").write_text(code.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    validate(from_args(["--rollout.function", "my_rollouts:once"]))

    class Engines:
        def generate(self, prompts, *, n, policy_version, **_):
            return [Sample(p.index, p.prompt, [1], "r", [2, 3], [-1.0, -1.0], p.label, policy_version)
                    for p in prompts for _ in range(n)]  # fmt: skip

    request = RolloutRequest([PromptItem(0, "a", "1"), PromptItem(1, "b", "2")], 2, 1.0, 1.0, 8, 3, 5)
    groups = get_rollout("my_rollouts:once")(Engines(), request)
    check_groups(groups, request, "my_rollouts:once")
    assert [[s.prompt_index for s in g] for g in groups] == [[0, 0], [1, 1]]
