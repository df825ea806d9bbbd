"""Evaluate a model on jsonl test sets with the paper's protocol: avg@k sampled at T=0.6 for data sources named
aime / aime25 / amc, greedy pass@1 for every other source. Prints a table per source and the average.

    .venv/bin/python scripts/evaluate.py --pretrain outputs/run/final --data.test aime24.jsonl,math500.jsonl \\
        --eval.n_samples 32 --rollout.max_new_tokens 8192 --rollout.max_model_len 9216

Takes the trainer's flags (dotted, see --help); several test files are separated by commas, `--eval.max_samples`
cuts each (0 = all). Without `--data.test`, the built-in task's test split.
"""

from __future__ import annotations

import sys

import entropy_openrlhf  # noqa: F401  (keeps a local Ray on loopback)
from entropy_openrlhf.config import ConfigError, from_args
from entropy_openrlhf.data.dataset import DatasetError
from entropy_openrlhf.pipeline.evaluation import evaluate
from entropy_openrlhf.pipeline.main import prepare
from rewards import VerifierLoadError


def main(argv: list[str] | None = None) -> int:
    cfg = from_args(argv, {"eval.max_samples": 0}, __doc__)
    try:
        model_path, _, items = prepare(cfg, need_train=False)
    except (ConfigError, DatasetError, VerifierLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # after the flags and the input checks, as in pipeline/main.py (its docstring): --help and bad input answer
    # without loading Ray
    import ray

    from entropy_openrlhf.actors.reward import RewardGroup
    from entropy_openrlhf.actors.rollout import RolloutGroup
    from entropy_openrlhf.cluster import init_ray

    started = init_ray(cfg.ray.num_cpus)
    rollout = RolloutGroup.from_config(cfg, model_path)  # the engines as training runs them (GPUs, dtype, vLLM flags)
    reward = RewardGroup.from_config(cfg)
    try:
        result = evaluate(rollout, reward, items, cfg)
    finally:
        rollout.shutdown()
        reward.shutdown()
        if started:
            ray.shutdown()
    print(f"{'source':<24} {'acc':>8}")
    for key, value in result.items():
        if key.endswith("/acc") and key != "eval/acc":
            print(f"{key[5:-4]:<24} {value:8.4f}")
    print(f"{'average':<24} {result.get('eval/acc', float('nan')):8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
