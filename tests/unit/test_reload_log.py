"""Which of vLLM's "Failed to load weights" messages a weight sync drops (sync/reload_log.KnownUnloadedFilter), on
stand-in modules shaped like vLLM's (the real engine is checked in tests/integration/test_weight_sync.py)."""

import logging

import torch

from entropy_openrlhf.sync.reload_log import (
    FAILED_TO_LOAD,
    LAYERWISE_LOGGER,
    KnownUnloadedFilter,
    checkpointless_layers,
)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(8, 4), persistent=False)


class StatefulNorm(torch.nn.Module):
    """A buffer that a checkpoint does carry: its absence would be a real failure."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))


class ParallelLMHead(torch.nn.Module):
    def __init__(self, weight=None):
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.ones(10, 4))


class Model(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 4)
        self.rotary_emb = RotaryEmbedding()
        self.norm = StatefulNorm()
        self.proj = torch.nn.Linear(4, 4)
        self.lm_head = ParallelLMHead(self.embed_tokens.weight if tied else None)


def test_only_layers_without_checkpoint_weights_are_listed():
    assert checkpointless_layers(Model(tied=True)) == {"RotaryEmbedding", "ParallelLMHead"}
    # an untied head has a weight of its own in every checkpoint: a failure to load it must stay in the log
    assert checkpointless_layers(Model(tied=False)) == {"RotaryEmbedding"}


def test_the_filter_drops_those_messages_and_counts_any_other():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(LAYERWISE_LOGGER + ".test")
    logger.propagate = False
    handler, log_filter = Keep(), KnownUnloadedFilter({"RotaryEmbedding", "ParallelLMHead"})
    logger.addHandler(handler)
    logger.addFilter(log_filter)
    try:
        logger.warning(FAILED_TO_LOAD, "RotaryEmbedding")
        logger.warning(FAILED_TO_LOAD, "ParallelLMHead")
        logger.warning(FAILED_TO_LOAD, "QKVParallelLinear")  # a real failure
        logger.warning("Allocating %.1f MB of device memory", 3.0)  # another message of the module
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(log_filter)
    assert records == ["QKVParallelLinear: Failed to load weights", "Allocating 3.0 MB of device memory"]
    assert (log_filter.dropped, log_filter.passed) == (2, 1)
