"""The reference's model on one rank (ReferenceActor, reference_actor.py): loaded as a plain transformers model, or
under DeepSpeed ZeRO-3 inference (reference_actor.py's docstring says when and how), and its forward-only passes.

Actor-only: it loads transformers, DeepSpeed and OpenRLHF (through forward.py), so only a reference rank imports it,
after `set_cpu_defaults`.
"""

from __future__ import annotations

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.deepspeed import HfDeepSpeedConfig

from entropy_openrlhf.actors.chunked_head import use_chunked_head
from entropy_openrlhf.actors.forward import SeqBatch, log_probs_by_micro_batch, make_seq_batch, use_shared_prefix
from entropy_openrlhf.config import Config, reference_micro_batch_size
from entropy_openrlhf.models.dtype import resolve_dtype
from entropy_openrlhf.rendezvous import init_default_group


def reference_ds_config(hidden_size: int, bf16: bool, micro_batch_size: int, offload: bool) -> dict:
    """DeepSpeed's inference config for the reference: OpenRLHF's `get_eval_ds_config` at stage 3. Its "auto"
    bucket sizes are filled with transformers' rules for them (integrations/deepspeed.py, `trainer_config_finalize`),
    which need the model's hidden size: parameters under 10 x hidden elements (norms, biases) stay whole on every
    rank, every other one is split over the ranks."""
    return {
        # DeepSpeed wants a batch size even without an optimizer; one micro-batch per forward, no accumulation
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
            # parameters wait in pinned host memory and are copied to the GPU module by module for each forward
            "offload_param": {"device": "cpu" if offload else "none", "pin_memory": True},
        },
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }


class ReferenceModel:
    """The frozen model on this rank's device (`index`: its GPU, None for the CPU), in eval mode."""

    def __init__(
        self, cfg: Config, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int,
        index: int | None, zero3: bool,
    ):  # fmt: skip
        self.cfg = cfg
        dtype = resolve_dtype(cfg.model.dtype, model_path)
        if zero3:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            init_default_group(backend, master_addr, master_port, rank, world_size, cfg.ray.start_timeout_s)
            deepspeed.init_distributed(dist_backend=backend)
            hidden = AutoConfig.from_pretrained(model_path).get_text_config().hidden_size
            ds_config = reference_ds_config(hidden, dtype == torch.bfloat16, reference_micro_batch_size(cfg),
                                            cfg.ref.offload)  # fmt: skip
            # alive for the actor's life: from_pretrained then loads inside zero.Init, so no rank ever holds the
            # whole model (policy_engine.py explains the weak reference transformers keeps to it)
            self._hf_ds_config = HfDeepSpeedConfig(ds_config)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            use_shared_prefix(model, cfg.train.shared_prefix)  # before DeepSpeed wraps it, as in the policy
            use_chunked_head(model, cfg.train.head_chunk_tokens)
            model.config.use_cache = False  # one forward per batch: a KV cache would only hold memory
            self.model, *_ = deepspeed.initialize(model=model, config=ds_config)
            self.device = self.model.device
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            use_shared_prefix(model, cfg.train.shared_prefix)
            use_chunked_head(model, cfg.train.head_chunk_tokens)
            model.config.use_cache = False
            self.device = "cpu" if index is None else f"cuda:{index}"
            self.model = model.to(self.device)
        self.model.eval()
        self.model_config = model.config
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        # parameter elements this rank holds in full after set-up: 0 under ZeRO-3, whose partitioned parameters have
        # an empty tensor (those below the persistence threshold are gathered, and kept, at the first forward)
        self.full_param_elements = sum(p.numel() for p in self.model.parameters())

    def batch(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> SeqBatch:
        return make_seq_batch(
            prompt_ids, response_ids, self.pad_id, shared_prefix=self.cfg.train.shared_prefix,
            model_config=self.model_config,
        ).to(self.device)  # fmt: skip

    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], sizes: list[int]):
        """Per-response log-probs from micro-batches of `sizes` (0: a stand-in), at the sampling temperature."""
        return log_probs_by_micro_batch(
            self.model, self.batch, prompt_ids, response_ids, sizes, temperature=self.cfg.rollout.temperature,
            pad_id=self.pad_id,
        )  # fmt: skip
