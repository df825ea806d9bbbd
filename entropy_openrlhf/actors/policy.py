"""The policy group: the driver's handle on the policy's DeepSpeed ranks (`actor.num_workers` PolicyActors,
policy_actor.py), data-parallel in one placement group. It shards each batch over the ranks, merges their metrics,
and submits every call to all ranks in one order."""

from __future__ import annotations

import threading
from typing import Any

import ray
import torch

from entropy_openrlhf.actors.group import ActorGroup
from entropy_openrlhf.actors.policy_actor import MAX_METRICS, SUMMED_LOSSES, PolicyActor, TrainSample, mean
from entropy_openrlhf.config import Config

__all__ = ["PolicyActor", "PolicyGroup", "TrainSample"]  # the actor and its sample type, where they always were


class PolicyGroup(ActorGroup):
    """Driver-side handle: creates the ranks in a placement group, shards each batch, gathers metrics."""

    def __init__(self, cfg: Config, model_path: str, local: bool = True):
        """`local`: the driver started this Ray itself (everything on 127.0.0.1)."""
        self.cfg, self.model_path = cfg, model_path
        self._submit = threading.Lock()  # see _on_all_ranks
        n = cfg.actor.num_workers
        bundle = {"CPU": cfg.actor.num_cpus_per_worker, **cfg.actor.custom_resources}
        if cfg.actor.num_gpus_per_worker:
            bundle["GPU"] = cfg.actor.num_gpus_per_worker
        super().__init__(n, bundle, f"the policy group ({n} rank(s) of {bundle})", cfg.ray.placement_timeout_s)

        def spawn(i: int, master_addr: str, master_port: int):
            return PolicyActor.options(
                num_cpus=cfg.actor.num_cpus_per_worker,
                num_gpus=cfg.actor.num_gpus_per_worker,
                resources=cfg.actor.custom_resources or None,
                scheduling_strategy=self.on_bundle(i),
            ).remote(cfg, model_path, i, n, master_addr, master_port)

        self._start_ranks(
            spawn, "get_version", lambda where: f"the policy group ({n} DeepSpeed rank(s){where})",
            cfg.ray.start_timeout_s, role="policy", local=local,
        )  # fmt: skip

    def _on_all_ranks(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """Call `method` on every rank. Calls of several driver threads (the trainer's step and sync, the rollout
        group re-exporting weights for a restarted engine) must reach every rank in the same order: ranks meet in
        collectives (ZeRO-3 gathers, DeepSpeed's all-reduce), so rank 0 running A then B while rank 1 runs B then
        A would deadlock. Submitting each call to all ranks under one lock keeps the order the same everywhere."""
        with self._submit:
            return [getattr(a, method).remote(*args) for a in self.actors]

    def train_step(
        self, samples: list[TrainSample], step: int, strength_scale: float = 1.0, entropy_coef: float | None = None
    ) -> dict[str, float]:
        """One RL step on all ranks; `strength_scale` and `entropy_coef` are the entropy controller's
        (PolicyActor.train_step)."""
        # Mini-batch m is the same samples whatever the number of ranks: each rank takes its slice of every one.
        n, n_mini = len(self.actors), self.cfg.train.mini_batches
        per_mini = len(samples) // n_mini
        per_rank = per_mini // n
        shards = [
            [s for m in range(n_mini) for s in samples[m * per_mini + r * per_rank : m * per_mini + (r + 1) * per_rank]]
            for r in range(n)
        ]
        with self._submit:
            refs = [a.train_step.remote(s, step, strength_scale, entropy_coef) for a, s in zip(self.actors, shards)]
        results = ray.get(refs)
        merged = {k: (max if k in MAX_METRICS else mean)([r[k] for r in results if k in r]) for k in results[0]}
        for key in SUMMED_LOSSES:
            merged[key] = sum(r[key] for r in results)
        merged["train/tokens"] = sum(r["train/tokens"] for r in results)
        return merged

    def export_weights(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Full HF-named weights from rank 0. With `timeout_s`, raises TimeoutError naming the policy when the ranks
        have not answered by then."""
        try:
            state = ray.get(self._on_all_ranks("export_weights"), timeout=timeout_s)[0]
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the policy group did not export its weights within {timeout_s:.0f} s (its ranks run their calls in "
                "order: a long training step delays the export)"
            ) from None
        return state

    def open_weight_sync(self, world_size: int, backend: str, timeout_s: float):
        """Collective weight sync set-up: rank 0's SyncEndpoint (host, port, backend, weight list)."""
        return ray.get(self._on_all_ranks("open_weight_sync", world_size, backend, timeout_s))[0]

    def join_weight_sync_async(self) -> ray.ObjectRef:
        """Rank 0 joins the group; it returns once every engine worker has joined too."""
        return self.actors[0].join_weight_sync.remote()

    def broadcast_weights_async(self) -> list[ray.ObjectRef]:
        """Every rank takes part (ZeRO-3 gathers); rank 0 broadcasts. The caller waits, with its timeout."""
        return self._on_all_ranks("broadcast_weights")

    def save_hf(self, path: str) -> None:
        """A complete HF folder: weights and config from the policy, plus the tokenizer (with its chat template) and
        generation config of the initial model, so vLLM and transformers load it with nothing else at hand."""
        ray.get(self._on_all_ranks("save_hf", path, self.model_path))

    def save_checkpoint(self, path: str, tag: str) -> None:
        ray.get(self._on_all_ranks("save_checkpoint", path, tag))

    def load_checkpoint(self, path: str, tag: str) -> None:
        ray.get(self._on_all_ranks("load_checkpoint", path, tag))

    def forward_log_probs(self, prompt_ids, response_ids):
        return ray.get(self.actors[0].forward_log_probs.remote(prompt_ids, response_ids))
