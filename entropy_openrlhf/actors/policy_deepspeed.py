"""A policy rank's DeepSpeed side (PolicyActor holds one): the ranks' process group, this rank's engine (built by
policy_engine.py, as scripts/gpu_check.py builds it), and what reads the policy's whole weights out of it.

Actor-only: DeepSpeed and transformers read their settings when imported (DS_ACCELERATOR, HF_HUB_OFFLINE), so
PolicyActor imports this module after `set_cpu_defaults`; the driver, which imports policy_actor.py to spawn the
ranks, never does (policy_actor.py's docstring).
"""

from __future__ import annotations

import os

import deepspeed
import torch
from transformers import AutoTokenizer, GenerationConfig

from entropy_openrlhf.actors import lora
from entropy_openrlhf.actors.policy_engine import build_policy_engine
from entropy_openrlhf.config import Config
from entropy_openrlhf.rendezvous import init_default_group
from entropy_openrlhf.sync.base import PolicyRank


class DeepSpeedPolicy:
    """This rank's policy under DeepSpeed. `built` is what building the engine gave (policy_engine.PolicyEngine),
    `host` what the weight syncs' senders know of this rank (its gathers are DeepSpeed's)."""

    def __init__(
        self, cfg: Config, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int, cuda: bool
    ):
        # The ranks meet on a store we host, not through "env://": torch's own rendezvous server listens on every
        # interface (rendezvous.py), ours only on master_addr. DeepSpeed then adopts the initialised group.
        backend = "nccl" if cuda else "gloo"
        init_default_group(backend, master_addr, master_port, rank, world_size, cfg.ray.start_timeout_s)
        deepspeed.init_distributed(dist_backend=backend)
        # the model, AdamW, the learning-rate schedule and the engine: the same code scripts/gpu_check.py steps
        self.built = build_policy_engine(cfg, model_path, world_size)
        zero3 = cfg.actor.zero_stage == 3
        module = self.built.engine.module
        self.lora = cfg.actor.lora_rank > 0
        gather_all = lambda params: deepspeed.zero.GatheredParameters(params, enabled=zero3)  # noqa: E731
        self.host = PolicyRank(
            module,
            rank,
            world_size,
            zero3=zero3,
            gathered=lambda param: gather_all([param]),
            # LoRA: the engines serve the base weights with the adapters' update merged (lora.py)
            named_weights=(lambda: lora.named_weights(module, gather_all)) if self.lora else None,
            weight_params=(lambda: lora.weight_params(module)) if self.lora else None,
        )
        self.gather_all = gather_all

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on CPU at rank 0, None elsewhere (every rank must call it: ZeRO-3 gathers the
        shards)."""
        # one parameter at a time: gathering a 32B model's shards at once would not fit on one GPU; under LoRA each
        # base weight with its adapter's update merged
        state = {}
        for name, tensor in self.host.weights():
            if self.host.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        return state if self.host.rank == 0 else None

    def save_hf(self, path: str, source: str) -> None:
        """Every rank: a complete HF folder at `path`, written by rank 0 (`source`: the model the run started from).
        Under LoRA the folder holds the merged model, and `path`/adapter the adapter alone as peft saves it (its
        `base_model_name_or_path` is the model the run started from)."""
        state = self.export_weights()
        if self.host.rank == 0:
            model = self.host.module.get_base_model() if self.lora else self.host.module
            model.save_pretrained(path, state_dict=state, safe_serialization=True)
            copy_tokenizer_and_generation_config(source, path)
        if self.lora:
            module = self.host.module
            module.peft_config[lora.ADAPTER].base_model_name_or_path = source
            # the adapter's parameters gathered at once (they are small), saved by peft from the module
            with self.gather_all([p for n, p in module.named_parameters() if lora.is_adapter_param(n)]):
                if self.host.rank == 0:
                    module.save_pretrained(os.path.join(path, "adapter"))


def copy_tokenizer_and_generation_config(source: str, target: str) -> None:
    """What `save_pretrained` of a model leaves out: the tokenizer files (chat template included) and the
    generation config (eos ids, sampling defaults), taken from the model the run started from."""
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    try:
        GenerationConfig.from_pretrained(source).save_pretrained(target)
    except OSError:  # the source has none: save_pretrained already wrote one derived from the model config
        pass
