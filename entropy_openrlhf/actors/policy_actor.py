"""The policy actor: one rank of the trainable model under DeepSpeed (the driver's handle is policy.PolicyGroup).

The actor holds the rank's state (the DeepSpeed engine, the policy version, the weight syncs' senders) and runs
its calls; an RL step's work is in train_phases.py, whose phases `train_step` runs in order: the old log-probs of
the shard, then one optimizer step per mini-batch on the objective `--loss.type` names. CPU machines use gloo and
torch's fused AdamW (DeepSpeed's CPU optimizers need a minute of JIT builds); GPU clusters use NCCL. Nothing else
differs.

DeepSpeed and transformers (through policy_deepspeed.py, the rank's DeepSpeed side) and train_phases.py (which loads
OpenRLHF's helpers) are imported in the actor's constructor ("actor-only imports"), for two reasons. The driver
imports this module too: PolicyGroup spawns this class, and would otherwise load them for nothing. And Ray imports
this module in the actor's process before `__init__` runs, while those libraries read their settings when they are
imported (DeepSpeed its DS_ACCELERATOR, huggingface_hub HF_HUB_OFFLINE), which `set_cpu_defaults` sets first. Two
imports, because train_phases.py comes after the model is built (policy_engine.py says why).
"""

from __future__ import annotations

import os
import random
import socket
import time
from typing import Any

import ray
import torch

from entropy_openrlhf.actors.devices import NOSET_VISIBLE_DEVICES, accelerator_error, local_device_index
from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.cluster import set_cpu_defaults
from entropy_openrlhf.config import Config
from entropy_openrlhf.sync.base import RankSender
from entropy_openrlhf.sync.factory import make_sender


@ray.remote
class PolicyActor:
    """One DeepSpeed rank of the policy. The driver calls every method on all ranks at once, in one order
    (actors/group.py `ActorGroup.call_all`): ranks meet in collectives in `train_step`, `export_weights`, the
    checkpoints and the weight syncs' operations."""

    def __init__(self, cfg: Config, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int):
        # The device comes from the GPUs Ray gave this actor (launcher.py in OpenRLHF sets LOCAL_RANK the same way).
        device_index = local_device_index(
            ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), bool(os.environ.get(NOSET_VISIBLE_DEVICES))
        )
        if device_index is None:
            # Ray 2.60 leaves a GPU-less actor every GPU of its node: this rank trains on the CPU, and must not take
            # cuda:0 from the actor Ray gave it to (set before anything in this process initialises CUDA)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            # DeepSpeed (engine device, zero.Init's local device) reads the device index from LOCAL_RANK
            LOCAL_RANK=str(device_index or 0),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        set_cpu_defaults()  # DS_ACCELERATOR=cpu unless this node has CUDA
        self.cuda = torch.cuda.is_available()
        error = accelerator_error(device_index, self.cuda, os.environ.get("DS_ACCELERATOR"), socket.gethostname())
        if error:
            raise RuntimeError(f"policy rank {rank}: {error}")
        if self.cuda:
            torch.cuda.set_device(device_index)  # before NCCL starts: its communicator binds the current device
        # actor-only import (module docstring): DeepSpeed and transformers, after set_cpu_defaults
        from entropy_openrlhf.actors.policy_deepspeed import DeepSpeedPolicy

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        # the process group, then the model, AdamW, the learning-rate schedule and the engine
        self.deepspeed = DeepSpeedPolicy(cfg, model_path, rank, world_size, master_addr, master_port, self.cuda)
        built = self.deepspeed.built
        self.engine, self.load_info = built.engine, built.load_info
        self._hf_ds_config = built.hf_ds_config  # ZeRO-3: keeps transformers' view of it alive (policy_engine.py)
        if rank == 0:
            print(
                f"[entropy-openrlhf] policy rank 0 loaded the model in {self.load_info['seconds']:.1f} s "
                f"(ZeRO-{cfg.actor.zero_stage}): {self.load_info['full_param_elements']:,} parameter elements held in "
                f"full, private host memory +{self.load_info['private_host_growth_bytes'] / 2**30:.2f} GiB"
            )
        # actor-only import (module docstring), after the model is built (policy_engine.py): the step's phases
        from entropy_openrlhf.actors import train_phases

        self.phases = train_phases  # train_step and forward_log_probs run them
        # Without dropout a training forward computes what an eval forward does, so train_step may take the first
        # mini-batch's old log-probs from its training forward.
        self.dropout_free = built.dropout_free
        self.model_path = model_path  # save_hf copies its tokenizer and generation config
        self.setup = train_phases.RankSetup(cfg, rank, world_size, built.pad_id)  # what the phases read of this rank
        self.senders: dict[str, RankSender] = {}  # one per weight sync method that runs code here (`sync`)
        self.version = 0

    # ------------------------------------------------------------------ the RL step

    def train_step(
        self,
        samples: list[TrainSample],
        step: int,
        strength_scale: float = 1.0,
        entropy_coef: float | None = None,
        micro_sizes: list[list[int]] | None = None,
    ) -> dict[str, float]:
        """One RL step on this rank's shard. `strength_scale` multiplies the objective's controlled knob
        (--entropy.target; 1 = as configured); `entropy_coef` is the entropy bonus's coefficient for this step (the
        controller's; None = --loss.entropy_coef); `micro_sizes` cuts the shard into micro-batches (the driver's
        layout, PolicyGroup.train_step; None: --actor.micro_batch_size sequences)."""
        t0 = time.time()
        s = self.phases.prepare_step(self.setup, self.engine, samples, step, strength_scale, entropy_coef, micro_sizes)
        # 1. old log-probs and entropies with the weights the optimizer steps start from. The first mini-batch's
        # come from its own training forward in 2: the weights have not moved yet, so they are the same numbers for
        # one forward fewer. Global selection needs them before that forward, and dropout would make the two differ:
        # both keep the separate pass. Under --offpolicy.bypass the old log-probs are the rollout's (prepare_step)
        # and no micro-batch takes the pass: each one's entropies and metrics come from its training forward.
        bypass = s.off_policy.bypass
        first_from_training = bypass or (self.dropout_free and not s.select_globally)
        # the micro-batches the no-grad pass computes: from no_grad_from on
        no_grad_from = len(s.batches) if bypass else len(s.minis[0]) if first_from_training else 0
        self.phases.old_log_probs(self.setup, self.engine, s, range(no_grad_from, len(s.batches)))
        # which path gave the old log-probs: both give the same numbers, so only this count tells them apart
        s.add("train/old_pass_micro_batches", len(s.batches) - no_grad_from)

        # 2. optimizer steps on the objective --loss.type names, its strength scaled by the entropy controller: one
        # per mini-batch in each of --train.ppo_epochs passes, against the same old log-probs (verl's ppo_epochs)
        self.engine.train()
        skipped = 0
        for epoch in range(s.epochs):
            for mini in range(len(s.minis)):
                # only the first pass's forwards stand in for the old pass: later ones see weights already moved
                old_from_training = epoch == 0 and (bypass or (first_from_training and mini == 0))
                if not self.phases.optimizer_step(self.setup, self.engine, s, mini, old_from_training, epoch):
                    skipped += 1
        self.version += 1
        # train/lr: the rate of the step's last optimizer step (the param groups already hold the next one's)
        return self.phases.step_result(
            s, world_size=self.world_size, skipped=skipped, lr=s.lr, seconds=time.time() - t0
        )

    def forward_log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """The trainer's log-probs of given responses (for the trainer-vs-vLLM check after a weight sync)."""
        return self.phases.response_log_probs(self.setup, self.engine, prompt_ids, response_ids)

    def reference_log_probs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], sizes: list[int]
    ) -> list[list[float]]:
        """LoRA's reference (reference.AdapterOffReference): the base model's log-probs, the adapter switched off,
        from micro-batches of `sizes` as a reference rank's (ReferenceActor.log_probs)."""
        return self.phases.reference_log_probs(self.setup, self.engine, prompt_ids, response_ids, sizes)

    # ------------------------------------------------------------------ weights out

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on CPU at rank 0 (every rank must call it: ZeRO-3 gathers the shards). The policy's
        own, whatever syncs them: the object-store sync, a restarted engine's reload and `save_hf` read them."""
        return self.deepspeed.export_weights()

    def sync(self, method: str, op: str, *args: Any) -> Any:
        """Operation `op` of weight sync `method`'s side on this rank (sync/, e.g. collective.py's CollectiveSender:
        open, join, broadcast), built on the method's first call and kept: the driver's `WeightSync.on_policy`."""
        sender = self.senders.get(method)
        if sender is None:
            sender = self.senders[method] = make_sender(method, self.deepspeed.host)
        return sender.run(op, *args)

    def save_hf(self, path: str) -> None:
        """A complete HF folder, written by rank 0: the weights and config, plus the tokenizer (with its chat
        template) and generation config of the model the run started from, so vLLM and transformers load it with
        nothing else at hand (written here, on rank 0's node, which reads the model folder anyway)."""
        self.deepspeed.save_hf(path, self.model_path)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, tag: str) -> None:
        # LoRA: the frozen base is the model the run started from; the checkpoint holds the adapters and their
        # optimizer state
        self.engine.save_checkpoint(path, tag=tag, exclude_frozen_parameters=self.cfg.actor.lora_rank > 0)
        # dropout draws from the global generators: keep this rank's, so a resumed run draws what this one would
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(path, tag, f"rng_rank{self.rank}.pt"))

    def load_checkpoint(self, path: str, tag: str) -> None:
        # DeepSpeed meets a missing checkpoint with a bare assert, or a log line and no load at all
        # LoRA: the frozen base is not in the checkpoint (save_checkpoint), so its parameters may be missing
        strict = self.cfg.actor.lora_rank == 0
        if not os.path.isdir(os.path.join(path, tag)) or (
            self.engine.load_checkpoint(path, tag=tag, load_module_strict=strict)[0] is None
        ):
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {path}")
        rng_file = os.path.join(path, tag, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):  # absent in checkpoints written before the RNG was saved
            rng = torch.load(rng_file, weights_only=False)
            random.setstate(rng["python"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])

    # ------------------------------------------------------------------ about this rank

    def get_version(self) -> int:
        return self.version

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def device_report(self) -> tuple[str, bool]:
        """Where this rank runs and whether it sees a CUDA device there (the weight sync's backend follows it)."""
        return f"node {ray.util.get_node_ip_address()}", torch.cuda.is_available()
