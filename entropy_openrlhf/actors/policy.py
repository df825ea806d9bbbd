"""The policy group: the driver's handle on the policy's DeepSpeed ranks (`actor.num_workers` PolicyActors,
policy_actor.py), data-parallel in one placement group. It shards each batch over the ranks and merges their
metrics (`train_step`); every other call is the group's generic one, on all ranks in one order (actors/group.py):

    policy.call_all("save_checkpoint", path, "state")
    state = policy.call_all("export_weights", timeout_s=300)[0]  # rank 0's answer
"""

from __future__ import annotations

from entropy_openrlhf.actors.group import ActorGroup
from entropy_openrlhf.actors.micro_batches import layout_for
from entropy_openrlhf.actors.policy_actor import PolicyActor
from entropy_openrlhf.actors.step_data import TrainSample, merge_ranks
from entropy_openrlhf.config import Config

__all__ = ["PolicyActor", "PolicyGroup", "TrainSample"]  # the actor and its sample type, where they always were


class PolicyGroup(ActorGroup):
    """Driver-side handle: creates the ranks in a placement group, shards each batch, gathers metrics."""

    def __init__(self, cfg: Config, model_path: str, local: bool = True):
        """`local`: the driver started this Ray itself (everything on 127.0.0.1)."""
        self.cfg = cfg
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

    def train_step(
        self, samples: list[TrainSample], step: int, strength_scale: float = 1.0, entropy_coef: float | None = None
    ) -> dict[str, float]:
        """One RL step on all ranks; `strength_scale` and `entropy_coef` are the entropy controller's
        (PolicyActor.train_step)."""
        # Mini-batch m is the same samples whatever the number of ranks or the split: each rank takes its share of
        # every one, cut into micro-batches by sequences or by a token budget (micro_batches.py)
        cfg = self.cfg
        layout = layout_for(
            [len(s.prompt_ids) + len(s.response_ids) for s in samples], [tuple(s.prompt_ids) for s in samples],
            cfg.train.mini_batches, len(self.actors), cfg.actor.micro_batch_size,
            cfg.train.max_tokens_per_micro_batch, keep_groups=cfg.train.shared_prefix != "off",
        )  # fmt: skip
        calls = [
            ([samples[i] for i in layout.order(r)], step, strength_scale, entropy_coef, layout.sizes(r))
            for r in range(len(self.actors))
        ]
        results = self.call_each("train_step", calls, timeout_s=cfg.train.step_timeout_s, what="--train.step_timeout_s")
        return merge_ranks(results)
