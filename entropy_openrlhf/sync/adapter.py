"""Adapter-only weight sync (`--sync.method adapter`; LoRA runs, `--actor.lora_rank r`): the engines load the base
model once, with vLLM's LoRA serving on, and each sync hands them only the adapter, megabytes where the model is
gigabytes. prime-rl and TRL sync LoRA runs the same way.

The trainer thread gathers the adapter on the policy ranks (ZeRO-3 gathers each of its parameters) and rank 0
returns it as peft saves it: `adapter_config.json` and `adapter_model.safetensors` (`publish`). The producer thread,
before its next generation, puts those bytes once in Ray's object store, and every engine writes them to a folder of
its own and serves them from then on (`RolloutEngine.load_adapter`: a new adapter name and id per version, so that
vLLM's prefix cache, keyed by the adapter's name and path, holds no blocks of the old one). vLLM loads adapters
from paths only; the folder is the engine's, on the engine's node, so no file system is shared.

An engine that Ray restarts comes back serving the base; `engine_back` gives it the last adapter again, also when it
died during a sync (`WeightSync.load_everywhere`).
"""

from __future__ import annotations

import json
import threading
import time

import ray
from safetensors.torch import save as safetensors_bytes

from entropy_openrlhf.sync.base import Engines, Policy, PolicyRank, RankSender, WeightSync, wait_for_sync
from entropy_openrlhf.sync.chunks import MB

ADAPTER_NAME = "default"  # peft's name for a model's one adapter, which its saved keys leave out


class AdapterSender(RankSender):
    """The policy ranks' side: the adapter's files, gathered on every rank, returned by rank 0."""

    def __init__(self, host: PolicyRank):
        super().__init__(host)
        if not hasattr(host.module, "peft_config"):
            raise ValueError("the adapter sync needs a LoRA policy (--actor.lora_rank > 0)")

    def export(self) -> dict[str, bytes] | None:
        """{file name: bytes} of the adapter as peft saves it, on rank 0; None on the other ranks (which must call it
        too under ZeRO-3: each parameter is gathered from all of them)."""
        tensors = {}
        for name, param in self.host.module.named_parameters():
            if ".lora_" not in name:
                continue
            with self.host.gathered(param):
                if self.host.rank == 0:
                    # peft's saved keys leave the adapter's name out (get_peft_model_state_dict)
                    tensors[name.replace(f".{ADAPTER_NAME}", "")] = param.detach().to("cpu", copy=True).contiguous()
        if self.host.rank != 0:
            return None
        config = self.host.module.peft_config[ADAPTER_NAME].to_dict()
        return {
            "adapter_config.json": json.dumps(config, default=_jsonable).encode(),
            "adapter_model.safetensors": safetensors_bytes(tensors),
        }


def _jsonable(value: object) -> object:
    """What json cannot write in a peft config: sets of module names (peft writes them as lists too)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot write {type(value).__name__} into adapter_config.json")


class AdapterSync(WeightSync):
    method = "adapter"
    sender = AdapterSender

    def __init__(self, rollout: Engines, policy: Policy, **settings: float):
        super().__init__(rollout, policy, **settings)
        self.pending: tuple[int, dict[str, bytes]] | None = None  # published, not yet in the engines
        self._pending_lock = threading.Lock()  # the trainer thread sets `pending`, the producer takes it
        self.synced: tuple[ray.ObjectRef, int] | None = None  # the last adapter the engines got, for restarts

    def describe(self) -> str:
        return "adapter only: the LoRA adapter through Ray's object store, served by vLLM's LoRA on the base"

    def publish(self, version: int) -> None:
        files = self.on_policy("export", timeout_s=self.policy_deadline_s, what="the adapter's export")[0]
        self.metrics["sync/mb"] = sum(len(b) for b in files.values()) / MB
        with self._pending_lock:
            self.pending = (version, files)

    def make_current(self) -> float:
        with self._pending_lock:
            pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        version, files = pending
        t0 = time.time()
        ref = ray.put(files)
        calls = [actor.load_adapter.remote(ref, version) for actor in self.rollout.actors]
        self.load_everywhere(calls, ref, version, f"adapter sync to policy version {version}")
        return time.time() - t0

    def engine_back(self, i: int, why: str, engine_version: int, restarted: bool, reload: bool) -> None:
        if not reload or engine_version == self.rollout.version or self.synced is None:
            return  # nothing synced yet: a restarted engine serves the base, version 0
        ref, version = self.synced
        wait_for_sync([self.rollout.actors[i].load_adapter.remote(ref, version)], [],
                      f"rollout engine {i} {why}: reloading the adapter of policy version {version}",
                      self.timeout_s)  # fmt: skip
