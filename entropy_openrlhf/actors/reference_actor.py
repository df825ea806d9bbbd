"""The reference actor: one rank of the frozen initial policy, giving reference log-probs of the rollouts (the
driver's handle is reference.ReferenceGroup).

Each rank runs on the GPU Ray gave it (the CPU when it gave none), in one of two ways
(`config.reference_uses_deepspeed`):
- one rank, no offload (the default): a plain transformers model in eval mode, the whole copy on one device;
- DeepSpeed ZeRO-3 inference, data-parallel over `--ref.num_workers` ranks, with optional CPU parameter offload
  (`--ref.offload`). This follows OpenRLHF's `ReferenceModelActor` (openrlhf/trainer/ray/launcher.py): the model is
  loaded under an `HfDeepSpeedConfig` (so `zero.Init` partitions it as it loads) with the eval config of
  `DeepspeedStrategy.get_ds_eval_config(offload=...)` (openrlhf/utils/deepspeed/deepspeed_utils.py,
  `get_eval_ds_config`), then wrapped by `deepspeed.initialize` without an optimizer.

A rank with fewer micro-batches than its peers runs a two-token stand-in for each one it lacks: every ZeRO-3 forward
gathers each module's parameters from all ranks. The ranks meet on a store bound to their master address
(rendezvous.py), as the policy's do.

The model itself is reference_model.py, imported in the actor's constructor ("actor-only import"): it loads
transformers, DeepSpeed and actors/forward.py (OpenRLHF), which the driver, importing this module for ReferenceGroup
to spawn, would otherwise load for nothing, and which in the actor must come after `set_cpu_defaults`
(huggingface_hub reads HF_HUB_OFFLINE when it is imported; DeepSpeed reads DS_ACCELERATOR).
"""

from __future__ import annotations

import os
import socket
import time

import ray
import torch

from entropy_openrlhf.actors.devices import NOSET_VISIBLE_DEVICES, accelerator_error, local_device_index
from entropy_openrlhf.cluster import set_cpu_defaults
from entropy_openrlhf.config import Config, reference_uses_deepspeed


@ray.remote
class ReferenceActor:
    def __init__(
        self, cfg: Config, model_path: str, rank: int = 0, world_size: int = 1, master_addr: str = "",
        master_port: int = 0,
    ):  # fmt: skip
        # the policy ranks' device choice: the GPU Ray gave this actor, or the CPU when it gave none (Ray 2.60
        # leaves a GPU-less actor every GPU of its node, and "cuda" would mean cuda:0, someone else's GPU)
        index = local_device_index(
            ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), bool(os.environ.get(NOSET_VISIBLE_DEVICES))
        )
        if index is None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything in this process initialises CUDA
        self.zero3 = reference_uses_deepspeed(cfg.ref)
        if self.zero3:
            # DeepSpeed (engine device, zero.Init's local device) reads the device index from LOCAL_RANK
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(index or 0),
                              MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))  # fmt: skip
        set_cpu_defaults()
        cuda = torch.cuda.is_available()
        # DS_ACCELERATOR matters only where DeepSpeed runs
        accelerator = os.environ.get("DS_ACCELERATOR") if self.zero3 else None
        error = accelerator_error(index, cuda, accelerator, socket.gethostname())
        if error:
            raise RuntimeError(f"reference rank {rank}: {error}")
        if index is not None:
            torch.cuda.set_device(index)  # before NCCL starts: its communicator binds the current device
        # actor-only import (module docstring): transformers, DeepSpeed and forward.py, after set_cpu_defaults
        from entropy_openrlhf.actors.reference_model import ReferenceModel

        self.cfg, self.rank = cfg, rank
        t0 = time.time()
        self.ref = ReferenceModel(cfg, model_path, rank, world_size, master_addr, master_port, index, self.zero3)
        self.full_param_elements = self.ref.full_param_elements
        if rank == 0:
            how = (
                f"ZeRO-3 over {world_size} rank(s), parameter offload {'on' if cfg.ref.offload else 'off'}"
                if self.zero3
                else "one rank, no DeepSpeed"
            )
            print(
                f"[entropy-openrlhf] reference rank 0 loaded the model in {time.time() - t0:.1f} s ({how}): "
                f"{self.full_param_elements:,} parameter elements held in full"
            )

    def log_probs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], sizes: list[int]
    ) -> list[list[float]]:
        """One list of per-token log-probs per response, in order, at the sampling temperature as the policy's (the
        KL term compares the two distributions at T), from micro-batches of `sizes` sequences (0: a stand-in, so
        that every rank of the group runs the same number of forwards; reference.py::dealt_log_probs)."""
        return self.ref.log_probs(prompt_ids, response_ids, sizes)

    def ready(self) -> dict[str, float]:
        """What this rank holds after set-up (start-up's wait calls it; tests read it)."""
        return {"full_param_elements": float(self.full_param_elements), "zero3": float(self.zero3)}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()
