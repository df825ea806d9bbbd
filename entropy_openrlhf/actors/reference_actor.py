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

transformers, DeepSpeed and actors/forward.py (which loads OpenRLHF, hence transformers, DeepSpeed and peft) are
imported inside the actor's methods ("actor-only imports"): the driver imports this module for ReferenceGroup to
spawn, and would otherwise load them for nothing, and in the actor they must come after `set_cpu_defaults`
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
from entropy_openrlhf.config import Config, reference_micro_batch_size, reference_uses_deepspeed
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
        from transformers import AutoConfig, AutoModelForCausalLM  # actor-only imports (module docstring)

        from entropy_openrlhf.actors.forward import use_shared_prefix

        self.cfg, self.rank, self.micro_batch_size = cfg, rank, reference_micro_batch_size(cfg)
        dtype = resolve_dtype(cfg.model.dtype, model_path)
        t0 = time.time()
        if self.zero3:
            import deepspeed  # actor-only imports (module docstring)
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            backend = "nccl" if cuda else "gloo"
            init_default_group(backend, master_addr, master_port, rank, world_size, cfg.ray.start_timeout_s)
            deepspeed.init_distributed(dist_backend=backend)
            hidden = AutoConfig.from_pretrained(model_path).get_text_config().hidden_size
            bf16 = dtype == torch.bfloat16
            ds_config = reference_ds_config(hidden, bf16, self.micro_batch_size, cfg.ref.offload)
            # alive for the actor's life: from_pretrained then loads inside zero.Init, so no rank ever holds the
            # whole model (PolicyActor explains the weak reference transformers keeps to it)
            self._hf_ds_config = HfDeepSpeedConfig(ds_config)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            use_shared_prefix(model, cfg.train.shared_prefix)  # before DeepSpeed wraps it, as in the policy
            model.config.use_cache = False  # one forward per batch: a KV cache would only hold memory
            self.model, *_ = deepspeed.initialize(model=model, config=ds_config)
            self.device = self.model.device
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            use_shared_prefix(model, cfg.train.shared_prefix)
            model.config.use_cache = False
            self.device = "cpu" if index is None else f"cuda:{index}"
            self.model = model.to(self.device)
        self.model.eval()
        self.model_config = model.config
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        # parameter elements this rank holds in full after set-up: 0 under ZeRO-3, whose partitioned parameters have
        # an empty tensor (those below the persistence threshold are gathered, and kept, at the first forward)
        self.full_param_elements = sum(p.numel() for p in self.model.parameters())
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

    def _batch(self, prompt_ids: list[list[int]], response_ids: list[list[int]]):
        from entropy_openrlhf.actors.forward import make_seq_batch  # actor-only imports (module docstring)

        return make_seq_batch(
            prompt_ids, response_ids, self.pad_id, shared_prefix=self.cfg.train.shared_prefix,
            model_config=self.model_config,
        ).to(self.device)  # fmt: skip

    def log_probs(
        self,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        forwards: int | None = None,
        sizes: list[int] | None = None,
    ) -> list[list[float]]:
        """One list of per-token log-probs per response, in order. `forwards`: how many forwards every rank of the
        group runs (ReferenceGroup.log_probs); this rank pads its own micro-batches up to it with stand-ins.
        `sizes`: the micro-batches to cut instead of --ref.micro_batch_size sequences each (a token budget's, whose
        0s are stand-ins; `forwards` is then their number)."""
        from entropy_openrlhf.actors.forward import forward_log_probs  # actor-only imports (module docstring)

        if sizes is None:
            step = self.micro_batch_size
            sizes = [min(step, len(prompt_ids) - i) for i in range(0, len(prompt_ids), step)]
            sizes += [0] * ((len(sizes) if forwards is None else forwards) - len(sizes))
        if sum(sizes) != len(prompt_ids) or (forwards is not None and len(sizes) > forwards):
            raise ValueError(
                f"reference rank {self.rank}: micro-batches {sizes} for {len(prompt_ids)} sequences in "
                f"{forwards} forwards"
            )
        out: list[list[float]] = []
        start = 0
        with torch.no_grad():
            for n in sizes:
                if n == 0:
                    # ZeRO-3: the other ranks' forwards gather parameters with this rank too, so it must run as many
                    forward_log_probs(self.model, self._batch([[self.pad_id]], [[self.pad_id]]))
                    continue
                b = self._batch(prompt_ids[start : start + n], response_ids[start : start + n])
                # at the sampling temperature, as the policy's: the KL term compares the two distributions at T
                lp, _ = forward_log_probs(self.model, b, temperature=self.cfg.rollout.temperature)
                out += [lp[j][b.mask[j].bool()].float().tolist() for j in range(lp.shape[0])]
                start += n
        return out

    def ready(self) -> dict[str, float]:
        """What this rank holds after set-up (start-up's wait calls it; tests read it)."""
        return {"full_param_elements": float(self.full_param_elements), "zero3": float(self.zero3)}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()
