"""A pipeline run in a process of its own (own local Ray, own environment), for tests that need settings every actor
must start with, such as VLLM_ENABLE_V1_MULTIPROCESSING=1. Run as
`python -m tests.integration.pipeline_check <flags>`; the last line printed is `RESULT <json>`:

- steps: the steps the run logged;
- in_process: whether the engines run vLLM's engine core in their own process;
- chunking: the last object-store sync's chunk counts (ObjectStoreSync.last_chunking);
- stale: the largest difference between the engines' and the policy's log-probs before the last sync is loaded;
- synced: the same after it (it must be small where `stale` is not).
"""

from __future__ import annotations

import json
import sys

PROMPT_IDS = [[1, 5, 6, 7, 8, 9]]
RESPONSE_IDS = [[20, 30, 40, 50, 60, 70, 80]]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def main(argv: list[str]) -> dict:
    import ray

    from entropy_openrlhf.cluster import init_ray
    from entropy_openrlhf.config import from_args
    from entropy_openrlhf.pipeline.main import prepare
    from entropy_openrlhf.pipeline.trainer import Trainer

    cfg = from_args(argv)
    init_ray(num_cpus=16)
    model_path, train_items, test_items = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, test_items)
    trainer.start_groups()
    try:
        history = trainer.run()
        policy = trainer.policy.call_all("forward_log_probs", PROMPT_IDS, RESPONSE_IDS)[0]
        stale = max_diff(trainer.rollout.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), policy)
        trainer.sync.make_current()  # the last step's export, which no generation has loaded yet
        synced = max_diff(trainer.rollout.sequence_log_probs(PROMPT_IDS, RESPONSE_IDS), policy)
        in_process = ray.get(trainer.rollout.actors[0].engine_core_in_process.remote(), timeout=60)
        return {
            "steps": [h["step"] for h in history],
            "in_process": in_process,
            "chunking": trainer.sync.last_chunking,
            "stale": stale,
            "synced": synced,
        }
    finally:
        trainer.shutdown_groups()
        ray.shutdown()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1:])), flush=True)
