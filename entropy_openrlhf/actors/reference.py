"""The reference group: the driver's handle on the frozen initial policy's ranks (ReferenceActor,
reference_actor.py), which give reference log-probs of the rollouts.

They feed the KL-to-reference metric (`kl/ref`) and, when `algo.kl_coef > 0`, a KL loss (off in the paper). One plain
rank by default; with `--ref.num_workers N` (or `--ref.offload`) N DeepSpeed ZeRO-3 ranks in their own placement
group (reference_actor.py tells the two apart).

Data parallelism: the batch is cut into micro-batches exactly as one rank would cut it, and each rank takes a
contiguous run of them (`deal_micro_batches`); all ranks run the same number of forwards, since every ZeRO-3 forward
gathers parameters from all of them. With a token budget (`--ref.max_tokens_per_micro_batch`, or the policy's) the
micro-batches are formed by tokens and balanced over the ranks instead (micro_batches.py::forward_batches).
"""

from __future__ import annotations

import math

from entropy_openrlhf.actors.group import ActorGroup
from entropy_openrlhf.actors.micro_batches import fixed_sizes, forward_batches
from entropy_openrlhf.actors.reference_actor import ReferenceActor
from entropy_openrlhf.config import (
    Config,
    reference_gpus,
    reference_max_tokens,
    reference_micro_batch_size,
    reference_uses_deepspeed,
)

__all__ = ["AdapterOffReference", "ReferenceActor", "ReferenceGroup", "deal_micro_batches"]


def deal_micro_batches(n: int, micro_batch_size: int, world_size: int) -> tuple[list[tuple[int, int]], int]:
    """Each rank's slice [start, end) of a batch of `n` sequences, and the number of forwards every rank runs.

    The batch is cut into micro-batches of `micro_batch_size` (the last may be shorter), as one rank cuts it, and
    rank r takes the r-th contiguous run of `forwards` of them; the last ranks may get fewer, or none. Slices start
    on micro-batch boundaries, so each rank's own cut reproduces the single rank's micro-batches: the same padding
    and the same shared-prefix layouts (a micro-batch of whole prompt groups stays whole)."""
    if micro_batch_size < 1 or world_size < 1:
        raise ValueError(f"micro_batch_size {micro_batch_size} and world_size {world_size} must be >= 1")
    forwards = math.ceil(math.ceil(n / micro_batch_size) / world_size)
    span = forwards * micro_batch_size
    return [(min(r * span, n), min((r + 1) * span, n)) for r in range(world_size)], forwards


class ReferenceGroup(ActorGroup):
    """Driver-side handle: the reference's ranks in a placement group; each batch dealt out, the results joined."""

    def __init__(self, cfg: Config, model_path: str, local: bool = True):
        """`local`: the driver started this Ray itself (everything on 127.0.0.1)."""
        self.cfg = cfg
        n, gpus, zero3 = cfg.ref.num_workers, reference_gpus(cfg), reference_uses_deepspeed(cfg.ref)
        bundle = {"CPU": cfg.ref.num_cpus, **cfg.ref.custom_resources}
        if gpus:
            bundle["GPU"] = gpus
        self.what = f"the reference group ({n} rank(s) of {bundle}{', DeepSpeed ZeRO-3' if zero3 else ''})"
        super().__init__(n, bundle, self.what, cfg.ray.placement_timeout_s)

        def spawn(i: int, master_addr: str = "", master_port: int = 0):
            return ReferenceActor.options(
                num_cpus=cfg.ref.num_cpus,
                num_gpus=gpus,
                resources=cfg.ref.custom_resources or None,
                scheduling_strategy=self.on_bundle(i),
            ).remote(cfg, model_path, i, n, master_addr, master_port)

        timeout = cfg.ray.start_timeout_s
        if zero3:
            self.load_info = self._start_ranks(
                spawn, "ready", lambda where: self.what + where, timeout, role="reference", local=local
            )
        else:  # one plain rank has no process group to meet in
            self.load_info = self._start(spawn, "ready", self.what, timeout)

    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """One list of per-token reference log-probs per response, in order, from all ranks."""
        return dealt_log_probs(self, self.cfg, prompt_ids, response_ids, "log_probs")


class AdapterOffReference:
    """The reference under LoRA (`--actor.lora_rank`): the policy's own ranks with the adapter switched off give the
    base model's log-probs (PolicyActor.reference_log_probs), so no reference group starts, as in verl. The batch is
    dealt over the policy's ranks as over a reference group's."""

    def __init__(self, cfg: Config, policy: ActorGroup):
        self.cfg, self.policy = cfg, policy

    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        return dealt_log_probs(self.policy, self.cfg, prompt_ids, response_ids, "reference_log_probs")

    def shutdown(self) -> None:
        """Nothing of its own to stop: the policy group shuts its ranks down."""


def dealt_log_probs(
    group: ActorGroup, cfg: Config, prompt_ids: list[list[int]], response_ids: list[list[int]], method: str
) -> list[list[float]]:
    """`method` on every rank of `group`, each with its deal of the batch and the sizes of the micro-batches to cut
    it into (0: a stand-in, so that every rank runs the same number of forwards); the answers put back in the
    batch's order."""
    n_ranks = len(group.actors)
    budget = reference_max_tokens(cfg)
    if budget:
        # by tokens: micro-batches of at most `budget`, balanced over the ranks, put back in order afterwards
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        ranks = forward_batches(lengths, n_ranks, budget)
        orders = [[i for micro in rank for i in micro] for rank in ranks]
        sizes = [[len(m) for m in rank] for rank in ranks]
    else:
        micro_batch_size = reference_micro_batch_size(cfg)
        shards, forwards = deal_micro_batches(len(prompt_ids), micro_batch_size, n_ranks)
        orders = [list(range(start, end)) for start, end in shards]
        sizes = [fixed_sizes(end - start, micro_batch_size, forwards) for start, end in shards]
    per_rank = [
        ([prompt_ids[i] for i in order], [response_ids[i] for i in order], rank_sizes)
        for order, rank_sizes in zip(orders, sizes)
    ]
    parts = group.call_each(method, per_rank, timeout_s=cfg.ref.timeout_s, what="--ref.timeout_s")
    out: list[list[float]] = [[] for _ in prompt_ids]
    for order, part in zip(orders, parts):
        for i, lp in zip(order, part, strict=True):
            out[i] = lp
    return out
