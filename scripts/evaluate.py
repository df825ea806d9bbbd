"""Evaluate a model on jsonl test sets: accuracy with the paper's protocol (avg@n sampled at T=0.6 for data sources
named aime / aime25 / amc, greedy pass@1 for every other source) and, with `--eval.n_samples` > 1, pass@k for
k = 1, 2, 4, ... n, maj@n and 95% bootstrap intervals over prompts for every source. Prints a table per source
and the average over sources; `--eval.output_json FILE` also writes every metric to FILE.

    .venv/bin/python scripts/evaluate.py --pretrain outputs/run/final --data.test aime24.jsonl,math500.jsonl \\
        --eval.n_samples 32 --rollout.max_new_tokens 8192 --rollout.max_model_len 9216
    .venv/bin/python scripts/evaluate.py --pretrain outputs/run/final --eval.n_samples 16 --eval.output_json e.json

Takes the trainer's flags (dotted, see --help); several test files are separated by commas, `--eval.max_samples`
cuts each (0 = all). Without `--data.test`, the built-in task's test split.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import entropy_openrlhf  # noqa: F401  (keeps a local Ray on loopback)
from entropy_openrlhf.config import ConfigError, from_args
from entropy_openrlhf.pipeline.evaluation import evaluate
from entropy_openrlhf.pipeline.main import prepare
from rewards import VerifierLoadError


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = from_args(argv, {"eval.max_samples": 0}, __doc__)  # --help and flag errors exit here
    except ValueError as e:  # an unknown --preset
        print(f"error: {e}", file=sys.stderr)
        return 2
    # after the flags, as in pipeline/main.py (its docstring): --help answers without the data loaders (datasets)
    from entropy_openrlhf.data.dataset import DatasetError

    try:
        out = Path(cfg.eval.output_json).parent if cfg.eval.output_json else None
        if out is not None and not out.is_dir():  # found now, not after the whole evaluation
            raise ConfigError(f"--eval.output_json {cfg.eval.output_json}: no folder {out} to write it in")
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
    from entropy_openrlhf.rollouts import ThroughRolloutFunction, get_rollout

    started = init_ray(cfg.ray.num_cpus)
    rollout = RolloutGroup.from_config(cfg, model_path)  # the engines as training runs them (GPUs, dtype, vLLM flags)
    reward = RewardGroup.from_config(cfg, model_path)
    try:
        # held-out prompts rolled out by --rollout.function, as in training
        engines = ThroughRolloutFunction(get_rollout(cfg.rollout.function), rollout, cfg.rollout.function)
        result = evaluate(engines, reward, items, cfg)
    finally:
        rollout.shutdown()
        reward.shutdown()
        if started:
            ray.shutdown()
    print(format_table(result))
    if cfg.eval.output_json:
        Path(cfg.eval.output_json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"metrics written to {cfg.eval.output_json}")
    return 0


def format_table(result: dict[str, float]) -> str:
    """One row per source and one for the average: acc, then pass@k and maj@n where sampled, then pass@1's and
    pass@n's 95% intervals."""
    sources = sorted({k.split("/")[1] for k in result if k.count("/") == 2 and k.startswith("eval/")})
    names = [
        k.split("/")[1] for k in result if k.count("/") == 1 and ("pass@" in k or "maj@" in k) and "_ci95" not in k
    ]
    names = sorted(names, key=lambda name: (name.startswith("maj@"), int(name.split("@")[1])))
    intervals = sorted({k.split("/")[-1].rsplit("_ci95", 1)[0] for k in result if "_ci95_low" in k})
    head = ["source", "acc", *names, *[f"{name} 95% CI" for name in intervals]]
    rows = []
    for label, prefix in [*[(src, f"eval/{src}/") for src in sources], ("average", "eval/")]:
        cells = [label] + [
            f"{result[prefix + name]:.4f}" if prefix + name in result else "" for name in ["acc", *names]
        ]
        for name in intervals:
            low, high = result.get(f"{prefix}{name}_ci95_low"), result.get(f"{prefix}{name}_ci95_high")
            cells.append(f"[{low:.3f}, {high:.3f}]" if low is not None else "")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
        for r in [head, *rows]
    )


if __name__ == "__main__":
    sys.exit(main())
