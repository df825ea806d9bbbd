"""Faults done for real on a local Ray cluster: rollout engines killed with SIGKILL (mid-generation and idle), a
weight sync to an engine that never answers, and a run whose every step has a non-finite loss.

The kill and the stall are real signals to the engine's process; the tests only choose the moment (the engine is
SIGSTOPped first, so the call it is killed in is certainly in flight)."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from entropy_openrlhf.samples import PromptItem

pytestmark = pytest.mark.integration

VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":digit_share"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def engine_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def tokens(samples) -> list[tuple[int, list[int]]]:
    return [(s.prompt_index, s.response_token_ids) for s in samples]


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


def test_killed_engine_is_restarted_reloaded_and_its_prompts_generated_again(ray_cluster, tiny_model):
    import ray
    from safetensors.torch import load_file

    from entropy_openrlhf.actors.rollout import RolloutGroup

    prompts = [PromptItem(index=i, prompt=CHAT.format(f"What is {i} + {i + 3}?"), label="") for i in range(4)]
    sampling = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=32, seed=11)
    original = load_file(f"{tiny_model}/model.safetensors")
    group = RolloutGroup(tiny_model, num_engines=2, num_cpus_per_engine=1, seed=0, max_model_len=512)
    try:
        from_disk = group.generate(prompts, policy_version=0, **sampling)
        group.update_weights(perturbed(original, 1), version=1, timeout_s=60)
        undisturbed = group.generate(prompts, policy_version=1, **sampling)
        assert tokens(undisturbed) != tokens(from_disk)  # a restarted engine that kept the disk weights would show

        # 1. engine 0 dies while its half of the prompts is in flight
        pid = engine_pid(group.actors[0])
        os.kill(pid, signal.SIGSTOP)  # frozen: the call below reaches it but cannot finish
        result: dict = {}

        def generate() -> None:
            result["out"] = group.generate(prompts, policy_version=1, **sampling)

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(2.0)
        assert worker.is_alive()  # the generation is in flight
        os.kill(pid, signal.SIGKILL)
        worker.join(timeout=600)
        assert not worker.is_alive()
        got = result["out"]
        assert group.restarts == 1 and engine_pid(group.actors[0]) != pid
        # the lost prompts were generated again, with the version-1 weights reloaded (per-prompt seeds: same tokens)
        assert tokens(got) == tokens(undisturbed)
        assert [s.policy_version for s in got] == [1] * len(got)
        assert ray.get([a.get_version.remote() for a in group.actors]) == [1, 1]

        # 2. engine 1 dies while idle; the next call is a weight sync, which still reaches every engine
        os.kill(engine_pid(group.actors[1]), signal.SIGKILL)
        time.sleep(1.0)
        group.update_weights(original, version=2, timeout_s=120)
        assert group.restarts == 2
        assert ray.get([a.get_version.remote() for a in group.actors]) == [2, 2]
        assert tokens(group.generate(prompts, policy_version=2, **sampling)) == tokens(from_disk)
    finally:
        group.shutdown()
