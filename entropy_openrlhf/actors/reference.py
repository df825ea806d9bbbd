"""The reference actor: the frozen initial policy, giving reference log-probs of the rollouts.

They feed the KL-to-reference metric (`kl/ref`) and, when `algo.kl_coef > 0`, a KL loss (off in the paper).
A plain transformers forward in eval mode; on GPUs the model goes to the actor's device.
"""

from __future__ import annotations

import ray
import torch


@ray.remote
class ReferenceActor:
    def __init__(self, model_path: str, dtype: str = "auto", micro_batch_size: int = 4):
        from entropy_openrlhf.cluster import set_cpu_defaults

        set_cpu_defaults()
        from transformers import AutoModelForCausalLM

        from entropy_openrlhf.actors.policy import resolve_dtype

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, model_path))
        self.model.to(self.device).eval()
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.micro_batch_size = micro_batch_size

    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """One list of per-token log-probs per response, in order."""
        from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch

        out: list[list[float]] = []
        step = self.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(prompt_ids), step):
                b = make_seq_batch(prompt_ids[i : i + step], response_ids[i : i + step], self.pad_id).to(self.device)
                lp, _ = forward_log_probs(self.model, b)
                out += [lp[j][b.mask[j].bool()].float().tolist() for j in range(lp.shape[0])]
        return out

    def ready(self) -> bool:
        return True
