"""The reference actor: the frozen initial policy, giving reference log-probs of the rollouts.

They feed the KL-to-reference metric (`kl/ref`) and, when `algo.kl_coef > 0`, a KL loss (off in the paper).
A plain transformers forward in eval mode, on the GPU Ray gave the actor (the CPU when it gave none).

transformers' model classes and actors/forward.py (which loads OpenRLHF, hence transformers, DeepSpeed and peft)
are imported inside the actor's methods ("actor-only imports"): the driver imports this module for ReferenceActor
and would otherwise load them for nothing, and in the actor they must come after `set_cpu_defaults`
(huggingface_hub reads HF_HUB_OFFLINE when it is imported).
"""

from __future__ import annotations

import os
import socket

import ray
import torch

from entropy_openrlhf.actors.policy import NOSET_VISIBLE_DEVICES, accelerator_error, local_device_index
from entropy_openrlhf.cluster import set_cpu_defaults
from entropy_openrlhf.models.dtype import resolve_dtype


@ray.remote
class ReferenceActor:
    def __init__(self, model_path: str, dtype: str = "auto", micro_batch_size: int = 4, shared_prefix: str = "off"):
        # the policy ranks' device choice: the GPU Ray gave this actor, or the CPU when it gave none (Ray 2.60
        # leaves a GPU-less actor every GPU of its node, and "cuda" would mean cuda:0, someone else's GPU)
        index = local_device_index(
            ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), bool(os.environ.get(NOSET_VISIBLE_DEVICES))
        )
        if index is None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything in this process initialises CUDA
        set_cpu_defaults()
        error = accelerator_error(index, torch.cuda.is_available(), None, socket.gethostname())
        if error:
            raise RuntimeError(f"reference actor: {error}")
        from transformers import AutoModelForCausalLM  # actor-only imports (module docstring)

        self.device = "cpu" if index is None else f"cuda:{index}"
        if index is not None:
            torch.cuda.set_device(index)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, model_path))
        from entropy_openrlhf.actors.forward import use_shared_prefix  # actor-only imports (module docstring)

        self.shared_prefix = shared_prefix
        use_shared_prefix(self.model, shared_prefix)
        self.model.to(self.device).eval()
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.micro_batch_size = micro_batch_size

    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """One list of per-token log-probs per response, in order."""
        from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch  # actor-only (module docstring)

        out: list[list[float]] = []
        step = self.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(prompt_ids), step):
                b = make_seq_batch(
                    prompt_ids[i : i + step], response_ids[i : i + step], self.pad_id,
                    shared_prefix=self.shared_prefix, model_config=self.model.config,
                ).to(self.device)  # fmt: skip
                lp, _ = forward_log_probs(self.model, b)
                out += [lp[j][b.mask[j].bool()].float().tolist() for j in range(lp.shape[0])]
        return out

    def ready(self) -> bool:
        return True

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()
