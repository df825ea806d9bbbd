"""Which of vLLM's "Failed to load weights" messages a weight sync's reload drops (receiver.py installs the filter in
each vLLM worker): the layers a trainer's state dict never has weights for say nothing a user should act on.

Apart from receiver.py, which imports vLLM at its top (it runs in vLLM's workers only), so that tests read this
logic without loading vLLM.
"""

from __future__ import annotations

import logging

import torch

# vLLM's layerwise reload (model_loader/reload/layerwise.py) logs "<layer class>: Failed to load weights" for every
# layer that has loadable tensors but received none in a reload, and then puts the layer's previous tensors back.
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_TO_LOAD = "%s: Failed to load weights"


def checkpointless_layers(model: torch.nn.Module) -> set[str]:
    """Class names of the layers a trainer's state dict never has weights for, so that vLLM's "Failed to load
    weights" about them says nothing a user should act on:

    - layers whose only tensors are non-persistent buffers (RotaryEmbedding's cos_sin_cache): computed from the
      config at start-up, never in a checkpoint, never changed by training; vLLM puts the same tensor back;
    - a tied lm_head: its weight is the embedding's, which the reload loads under the embedding's name
      (`_reload_named_weights` then redoes its CPU repack).

    A layer with a parameter of its own is never listed: a real failure to load it stays in the log."""
    names = set()
    for module in model.modules():
        buffers = [n for n, b in module._buffers.items() if b is not None]
        own_params = [p for p in module._parameters.values() if p is not None]
        if buffers and not own_params and set(buffers) <= set(module._non_persistent_buffers_set):
            names.add(type(module).__name__)
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if weight is not None and any(m is not lm_head and getattr(m, "weight", None) is weight for m in model.modules()):
        names.add(type(lm_head).__name__)
    return names


class KnownUnloadedFilter(logging.Filter):
    """Drops vLLM's "Failed to load weights" for `names` (see checkpointless_layers); counts what it drops and the
    same message about any other layer, which it lets through."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names, self.dropped, self.passed = set(names), 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != FAILED_TO_LOAD or not record.args:
            return True
        if record.args[0] in self.names:
            self.dropped += 1
            return False
        self.passed += 1
        return True
