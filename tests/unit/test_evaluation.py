"""The evaluation protocol's routing and arithmetic (pipeline/evaluation.py), with stand-ins for the rollout and
reward groups: which prompts are sampled at T=0.6 and how often, which are greedy, and how accuracies are averaged.
The real groups run it in tests/integration/test_evaluation.py."""

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.evaluation import evaluate
from entropy_openrlhf.samples import PromptItem, Sample


class RecordingRollout:
    """Answers `n` responses per prompt and records each call's sampling settings."""

    def __init__(self):
        self.calls = []

    def generate(self, items, *, n, temperature, top_p, max_new_tokens, seed, policy_version):
        self.calls.append({"sources": [p.data_source for p in items], "n": n, "temperature": temperature})
        return [
            Sample(
                prompt_index=p.index,
                prompt=p.prompt,
                prompt_token_ids=[1],
                response=f"r{j}",
                response_token_ids=[7] * (j + 1),
                rollout_log_probs=[0.0] * (j + 1),
                label=p.label,
                policy_version=policy_version,
                data_source=p.data_source,
            )  # fmt: skip
            for p in items
            for j in range(n)
        ]


class LabelIsAnswer:
    """Marks a response correct when it equals the label, so a test chooses each prompt's outcome."""

    def score(self, samples):
        for s in samples:
            s.acc = s.response == s.label
        return samples, {}


def item(index: int, source: str, label: str) -> PromptItem:
    return PromptItem(index, f"q{index}", label, source, {})


def test_competition_sources_are_sampled_k_times_and_the_rest_greedy():
    cfg = from_args(["--eval.n_samples", "4"])
    items = [item(0, "AIME", "r0"), item(1, "math", "r0"), item(2, "amc", "r0"), item(3, "aime25", "r0")]
    rollout = RecordingRollout()
    evaluate(rollout, LabelIsAnswer(), items, cfg)
    greedy = [c for c in rollout.calls if c["temperature"] == 0.0]
    sampled = [c for c in rollout.calls if c["temperature"] == 0.6]
    assert len(greedy) == len(sampled) == 1
    assert greedy[0] == {"sources": ["math"], "n": 1, "temperature": 0.0}
    assert sampled[0]["sources"] == ["AIME", "amc", "aime25"] and sampled[0]["n"] == 4


def test_avg_at_k_per_source_and_the_average_over_sources_not_samples():
    cfg = from_args(["--eval.n_samples", "4"])
    # aime: one of four samples matches ("r2") -> avg@4 = 0.25; math (greedy, one sample "r0"): 2 of 3 right;
    # rows without a data_source are grouped as "default"
    items = [
        item(0, "aime", "r2"),
        item(1, "math", "r0"), item(2, "math", "r0"), item(3, "math", "wrong"),
        item(4, "", "r0"),
    ]  # fmt: skip
    out = evaluate(RecordingRollout(), LabelIsAnswer(), items, cfg)
    assert out["eval/aime/acc"] == 0.25
    assert abs(out["eval/math/acc"] - 2 / 3) < 1e-12
    assert out["eval/default/acc"] == 1.0
    assert abs(out["eval/acc"] - (0.25 + 2 / 3 + 1.0) / 3) < 1e-12
    # four aime responses of 1..4 tokens, four greedy responses of 1 token
    assert out["eval/response_len"] == (1 + 2 + 3 + 4 + 4 * 1) / 8


def test_no_prompts_no_metrics():
    rollout = RecordingRollout()
    assert evaluate(rollout, LabelIsAnswer(), [], from_args([])) == {}
    assert rollout.calls == []
