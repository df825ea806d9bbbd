"""The policy actor: one rank of the trainable model under DeepSpeed (the driver's handle is policy.PolicyGroup).

One RL step on a rank's shard of the rollout batch:
1. recompute the old log-probs (and token entropies) with the current weights, no grad (the first mini-batch's
   come from its own training forward in 3, before any weight has moved, when the model has no dropout and the
   selection is per micro-batch);
2. split the shard into `train.mini_batches` optimizer steps, each into micro-batches;
3. per micro-batch: forward, the objective `--loss.type` names (algorithms/objectives/: its token selection, then
   its loss), backward; one optimizer
   step per mini-batch, with the loss normalised over the whole mini-batch on all ranks so that micro-batching and
   sharding do not change it.
CPU machines use gloo and torch's fused AdamW (DeepSpeed's CPU optimizers need a minute of JIT builds); GPU clusters
use NCCL. Nothing else differs.

DeepSpeed, transformers' model classes and OpenRLHF's helpers (through actors/forward.py) are imported inside the
actor's methods ("actor-only imports"), for two reasons. The driver imports this module too: PolicyGroup spawns
this class, and would otherwise load them for nothing. And Ray imports this module in the actor's process before
`__init__` runs, while those libraries read their settings when they are imported (DeepSpeed its DS_ACCELERATOR,
huggingface_hub HF_HUB_OFFLINE), which `set_cpu_defaults` sets first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from entropy_openrlhf.actors.devices import NOSET_VISIBLE_DEVICES, accelerator_error, local_device_index
from entropy_openrlhf.algorithms.losses import aggregate, entropy_bonus
from entropy_openrlhf.algorithms.metrics import entropy_stats
from entropy_openrlhf.algorithms.objectives import (
    LossContext,
    TokenBatch,
    get_objective,
    objective_needs_entropy,
    run_objective,
    select_tokens,
)
from entropy_openrlhf.algorithms.selection import pooled_selection
from entropy_openrlhf.cluster import set_cpu_defaults
from entropy_openrlhf.config import Config
from entropy_openrlhf.models.dtype import resolve_dtype
from entropy_openrlhf.rendezvous import init_default_group
from entropy_openrlhf.sync.group import WeightSender


@dataclass
class TrainSample:
    """What the policy needs of one response; the driver builds these from `Sample`s."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_log_probs: list[float]
    ref_log_probs: list[float] | None = None


MAX_METRICS = {"rollout/logprob_diff_max"}  # reduced over micro-batches and ranks by max, the rest by mean
# each rank's value is its share of the mini-batch mean (aggregate's normaliser spans all ranks): summed over ranks
SUMMED_LOSSES = ("loss/policy", "loss/entropy_bonus")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class _Step:
    """One train step on this rank: its settings, its micro-batches (mini-batch m is micro-batches
    [m * micro_per_mini, (m + 1) * micro_per_mini)) with their per-token grids, and what the step learns of them
    (old log-probs, entropies, IS weights, metrics) as it goes."""

    step: int
    params: Any  # the objective's settings, scaled by the entropy controller
    select_globally: bool
    needs_entropy: bool
    bonus_coef: float
    micro_per_mini: int
    batches: list
    advantages: list[torch.Tensor]
    rollout_lp: list[torch.Tensor]
    ref_lp: list[torch.Tensor] | None
    old_lp: list[torch.Tensor | None]
    entropies: list[torch.Tensor | None]
    is_weights: list[torch.Tensor | None]
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.metrics.setdefault(key, []).append(float(value))


@ray.remote
class PolicyActor:
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
        import deepspeed  # actor-only imports (module docstring)
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        # The ranks meet on a store we host, not through "env://": torch's own rendezvous server listens on every
        # interface (rendezvous.py), ours only on master_addr. DeepSpeed then adopts the initialised group.
        backend = "nccl" if self.cuda else "gloo"
        init_default_group(backend, master_addr, master_port, rank, world_size, cfg.ray.start_timeout_s)
        deepspeed.init_distributed(dist_backend=backend)
        self.dtype = resolve_dtype(cfg.model.dtype, model_path)
        per_rank = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt // cfg.train.mini_batches // world_size
        self.micro_per_step = math.ceil(per_rank / cfg.actor.micro_batch_size)
        ds_config = {
            "train_micro_batch_size_per_gpu": cfg.actor.micro_batch_size,
            "gradient_accumulation_steps": self.micro_per_step,
            "gradient_clipping": cfg.actor.grad_clip,
            "zero_optimization": {"stage": cfg.actor.zero_stage},
            # with check_grad_overflow DeepSpeed skips bf16 steps with non-finite gradients (fp32 ZeRO does by default)
            "bf16": {"enabled": self.dtype == torch.bfloat16, "check_grad_overflow": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        # ZeRO-3: with an HfDeepSpeedConfig alive, from_pretrained builds the model inside deepspeed.zero.Init (each
        # parameter partitioned on this rank's device as its module is created) and fills it one module at a time:
        # rank 0 copies the checkpoint's tensors into the gathered parameters, the other ranks receive them, each
        # keeps its partition. No rank holds the whole model and only rank 0 reads the checkpoint. Without it every
        # rank holds the whole model until DeepSpeed partitions it: as mmap'd views of the safetensors files when
        # their dtype is the training dtype, but as a private copy when cast (131 GB per rank for 32B in fp32).
        # transformers finds the config only through a weak reference (integrations/deepspeed.py,
        # is_deepspeed_zero3_enabled), so this reference keeps it alive for the actor's life, as its docstring asks:
        # transformers calls made later in this process (embedding resizes, weight inits) must see ZeRO-3 too.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config) if cfg.actor.zero_stage == 3 else None
        private_before, t0 = _private_host_bytes(), time.time()
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.load_info = {
            "seconds": time.time() - t0,
            # parameter elements this rank holds in full: 0 under zero.Init (each keeps only its partition)
            "full_param_elements": sum(p.numel() for p in model.parameters()),
            # anonymous memory the load left in this process; the checkpoint's mmap'd file pages are not counted
            # (the page cache holds them once per node)
            "private_host_growth_bytes": _private_host_bytes() - private_before,
        }
        if rank == 0:
            print(
                f"[entropy-openrlhf] policy rank 0 loaded the model in {self.load_info['seconds']:.1f} s "
                f"(ZeRO-{cfg.actor.zero_stage}): {self.load_info['full_param_elements']:,} parameter elements held in "
                f"full, private host memory +{self.load_info['private_host_growth_bytes'] / 2**30:.2f} GiB"
            )
        from entropy_openrlhf.actors.forward import use_shared_prefix  # actor-only imports (module docstring)

        use_shared_prefix(model, cfg.train.shared_prefix)  # before DeepSpeed wraps it; each batch brings its layout
        if cfg.actor.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        # Without dropout a training forward computes what an eval forward does, so train_step may take the first
        # mini-batch's old log-probs from its training forward.
        self.dropout_free = not getattr(model.config, "attention_dropout", 0.0) and not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
        )
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        # under zero.Init these are already partitioned parameters; DeepSpeed's ZeRO-3 optimizer takes them as such
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.actor.lr,
            betas=tuple(cfg.actor.adam_betas),
            eps=cfg.actor.adam_eps,
            weight_decay=cfg.actor.weight_decay,
            # one kernel over all parameters: on CPU 0.18 s per step for SmolLM2 against 0.6 s for the default
            # per-tensor loop (docs/benchmarks.md); the same update up to rounding
            fused=True,
        )
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.version = 0

    # ------------------------------------------------------------------ helpers

    def _batch(self, samples: list[TrainSample]):
        return self._seq_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples]).to(
            self.engine.device
        )

    def _seq_batch(self, prompt_ids: list[list[int]], response_ids: list[list[int]]):
        from entropy_openrlhf.actors.forward import make_seq_batch  # actor-only imports (module docstring)

        return make_seq_batch(
            prompt_ids, response_ids, self.pad_id, shared_prefix=self.cfg.train.shared_prefix,
            model_config=self.engine.module.config,
        )  # fmt: skip

    def _grid(self, values, batch, samples):
        from entropy_openrlhf.actors.forward import to_token_grid  # actor-only imports (module docstring)

        return to_token_grid(values, batch, [len(s.prompt_ids) for s in samples]).to(batch.mask.device)

    def _all_reduce_sum(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        if self.world_size > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def _generator(self, step: int, mini: int, micro: int) -> torch.Generator:
        # micro_batch scope: a different draw per rank; global scope: all ranks draw the same (they must agree).
        rank = 0 if self.cfg.loss.scope == "global" else self.rank
        seed = (self.cfg.train.seed * 1_000_003 + step * 10_007 + mini * 101 + micro * 7 + rank * 1_009) % 2**63
        return torch.Generator().manual_seed(seed)

    def _pooled_selector(self, params, base: LossContext, generator: torch.Generator):
        """The objective's selection over tokens pooled from a whole mini-batch (`pooled_selection`'s callback)."""
        lc = self.cfg.loss

        def select(tokens: TokenBatch, means: tuple[float, float]):
            ctx = dataclasses.replace(base, cov_means=means, generator=generator)
            return select_tokens(lc.type, params, lc, tokens, ctx)

        return select

    # ------------------------------------------------------------------ the RL step

    def train_step(
        self, samples: list[TrainSample], step: int, strength_scale: float = 1.0, entropy_coef: float | None = None
    ) -> dict[str, float]:
        """One RL step on this rank's shard. `strength_scale` multiplies the objective's controlled knob
        (--entropy.target; 1 = as configured); `entropy_coef` is the entropy bonus's coefficient for this step (the
        controller's; None = --loss.entropy_coef)."""
        t0 = time.time()
        s = self._prepare_step(samples, step, strength_scale, entropy_coef)
        # 1. old log-probs and entropies with the weights the optimizer steps start from. The first mini-batch's
        # come from its own training forward in 2: the weights have not moved yet, so they are the same numbers for
        # one forward fewer. Global selection needs them before that forward, and dropout would make the two differ:
        # both keep the separate pass.
        first_from_training = self.dropout_free and not s.select_globally
        no_grad_from = s.micro_per_mini if first_from_training else 0  # the micro-batches the no-grad pass computes
        self._old_log_probs(s, range(no_grad_from, len(s.batches)))
        # which path gave the old log-probs: both give the same numbers, so only this count tells them apart
        s.add("train/old_pass_micro_batches", len(s.batches) - no_grad_from)

        # 2. optimizer steps on the objective --loss.type names, its strength scaled by the entropy controller
        self.engine.train()
        skipped = 0
        for mini in range(self.cfg.train.mini_batches):
            if not self._optimizer_step(s, mini, old_from_training=first_from_training and mini == 0):
                skipped += 1
        self.version += 1
        return self._step_result(s, skipped, t0)

    def _prepare_step(
        self, samples: list[TrainSample], step: int, strength_scale: float, entropy_coef: float | None
    ) -> _Step:
        """The shard cut into mini-batches of micro-batches, on the device, with their per-token grids, and the
        settings of the objective for this step."""
        cfg = self.cfg
        mbs, n_mini = cfg.actor.micro_batch_size, cfg.train.mini_batches
        per_mini = len(samples) // n_mini
        if per_mini * n_mini != len(samples):
            raise ValueError(f"{len(samples)} samples on rank {self.rank} do not split into {n_mini} mini-batches")
        # mini-batch m is micro-batches [m * micro_per_mini, (m + 1) * micro_per_mini)
        micro = [
            samples[start + i : start + min(i + mbs, per_mini)]
            for start in range(0, len(samples), per_mini)
            for i in range(0, per_mini, mbs)
        ]
        batches = [self._batch(m) for m in micro]

        def grid(values_of) -> list[torch.Tensor]:  # one value per response token, as a (B, L) tensor per micro-batch
            return [self._grid([values_of(s) for s in m], b, m) for m, b in zip(micro, batches)]

        has_ref = all(s.ref_log_probs is not None for s in samples)
        lc = cfg.loss
        objective = get_objective(lc.type)
        return _Step(
            step=step,
            params=objective.scaled(getattr(lc, lc.type), strength_scale, cfg.entropy.knob),
            select_globally=lc.scope == "global" and objective.select is not None,
            needs_entropy=objective_needs_entropy(lc.type, lc),
            bonus_coef=lc.entropy_coef if entropy_coef is None else float(entropy_coef),
            micro_per_mini=len(micro) // n_mini,
            batches=batches,
            advantages=grid(lambda s: [s.advantage] * len(s.response_ids)),
            rollout_lp=grid(lambda s: s.rollout_log_probs),
            ref_lp=grid(lambda s: s.ref_log_probs) if has_ref else None,
            old_lp=[None] * len(batches),
            entropies=[None] * len(batches),
            is_weights=[None] * len(batches),
        )

    def _old_log_probs(self, s: _Step, indices: range) -> None:
        """The no-grad pass: old log-probs and token entropies of the micro-batches `indices`, then their metrics."""
        from entropy_openrlhf.actors.forward import forward_log_probs  # actor-only imports (module docstring)

        self.engine.eval()
        with torch.no_grad():
            for i in indices:
                lp, s.entropies[i] = forward_log_probs(self.engine, s.batches[i], with_entropy=True)
                s.old_lp[i] = lp.float()
        for i in indices:
            self._observe_old(s, i)

    def _observe_old(self, s: _Step, i: int) -> None:
        """Metrics of micro-batch i's old log-probs against the rollout and the reference; its IS weights."""
        from openrlhf.models.utils import compute_approx_kl  # actor-only imports (module docstring)

        cfg = self.cfg
        b, lp, r = s.batches[i], s.old_lp[i], s.rollout_lp[i]
        if cfg.use_is_correction:
            s.is_weights[i] = torch.exp((lp - r).clamp(-20, 20)).clamp(max=cfg.async_.is_cap)
        n = int(b.mask.sum())
        if n == 0:
            return
        es = entropy_stats(s.entropies[i], b.mask)
        s.add("entropy/token_mean", es["token_mean"])
        s.add("entropy/seq_mean", es["seq_mean"])
        s.add("rollout/vllm_kl", float(((r - lp) * b.mask).sum() / n))
        # the weight-sync check: with max_staleness 0 the engine holds the trainer's weights, so only numerics
        gap = (r - lp).abs() * b.mask
        s.add("rollout/logprob_diff_max", float(gap.max()))
        s.add("rollout/logprob_diff_mean", float(gap.sum() / n))
        if s.ref_lp is not None:
            kl = compute_approx_kl(lp, s.ref_lp[i], kl_estimator=cfg.algo.kl_estimator)
            s.add("kl/ref", float((kl * b.mask).sum() / n))
        if s.is_weights[i] is not None:
            w = s.is_weights[i]
            s.add("rollout/is_weight_mean", float((w * b.mask).sum() / n))
            s.add("rollout/is_capped_frac", float(((w >= cfg.async_.is_cap) * b.mask).sum() / n))

    def _optimizer_step(self, s: _Step, mini: int, old_from_training: bool) -> bool:
        """Mini-batch `mini`: its selection (global scope), then forward, loss and backward per micro-batch, and one
        optimizer step. `old_from_training`: its old log-probs come from these forwards. Whether DeepSpeed applied
        the step (it skips one whose gradient norm is NaN/Inf and leaves the weights as they were)."""
        lc = self.cfg.loss
        idx = list(range(mini * s.micro_per_mini, (mini + 1) * s.micro_per_mini))
        local_tokens = sum(float(s.batches[i].mask.sum()) for i in idx)
        local_seqs = sum(float((s.batches[i].mask.sum(-1) > 0).sum()) for i in idx)
        tokens, sequences = self._all_reduce_sum(local_tokens, local_seqs)
        base = LossContext(
            clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip or None, agg=lc.agg,
            tokens=tokens, sequences=sequences, dp_size=self.world_size, micro_batches=s.micro_per_mini,
        )  # fmt: skip
        selections: dict[int, torch.Tensor | None] = {i: None for i in idx}
        if s.select_globally:
            selections, base = self._select_globally(s, mini, idx, base)
        for j, i in enumerate(idx):
            # micro_batch scope: selections[i] is None and the objective selects here
            ctx = dataclasses.replace(base, generator=self._generator(s.step, mini, j), selected=selections[i])
            self._train_micro_batch(s, i, ctx, old_from_training)
        if not self.engine.was_step_applied():
            return False
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            s.add("train/grad_norm", float(grad_norm))
        return True

    def _select_globally(
        self, s: _Step, mini: int, idx: list[int], base: LossContext
    ) -> tuple[dict[int, torch.Tensor], LossContext]:
        """`--loss.scope global`: the objective's selection over the whole mini-batch on all ranks; the masks per
        micro-batch and the loss context that carries the pooled means and count."""
        from entropy_openrlhf.actors.forward import forward_log_probs  # actor-only imports (module docstring)

        if mini == 0:  # the weights have not moved yet this step: the old pass's values are current
            current = [(s.old_lp[i], s.entropies[i]) for i in idx]
        else:
            with torch.no_grad():
                current = [forward_log_probs(self.engine, s.batches[i], with_entropy=s.needs_entropy) for i in idx]
        pooled = [
            TokenBatch(lp.float(), s.old_lp[i], s.advantages[i], s.batches[i].mask, entropy=ent)
            for (lp, ent), i in zip(current, idx)
        ]
        select = self._pooled_selector(s.params, base, self._generator(s.step, mini, 0))
        masks, cov_means, total, selection_metrics = pooled_selection(pooled, select, with_entropy=s.needs_entropy)
        for k, v in selection_metrics.items():
            s.add(k, v)
        return dict(zip(idx, masks)), dataclasses.replace(base, cov_means=cov_means, selected_total=float(total))

    def _train_micro_batch(self, s: _Step, i: int, ctx: LossContext, old_from_training: bool) -> None:
        """Forward, the objective's loss (plus the KL and entropy-bonus terms) and backward of micro-batch i."""
        from openrlhf.models.utils import compute_approx_kl  # actor-only imports (module docstring)

        from entropy_openrlhf.actors.forward import forward_log_probs

        cfg, lc, b = self.cfg, self.cfg.loss, s.batches[i]
        with_bonus = s.bonus_coef > 0  # at 0 no entropy gradient is computed: the bonus off costs nothing
        lp, ent = forward_log_probs(
            self.engine, b, with_entropy=s.needs_entropy or old_from_training, entropy_grad=with_bonus
        )
        if old_from_training:
            s.old_lp[i], s.entropies[i] = lp.detach().float(), ent.detach()
            self._observe_old(s, i)
        # the objective's selection reads the entropy detached; only the bonus differentiates it
        entropy = ent.detach() if s.needs_entropy else None
        out, selection_metrics = run_objective(
            lc.type, s.params, lc, ctx, lp, s.old_lp[i], s.advantages[i], b.mask, entropy=entropy,
            is_weights=s.is_weights[i],
        )  # fmt: skip
        for k, v in selection_metrics.items():
            s.add(k, v)
        loss = out.loss
        if cfg.algo.kl_coef > 0 and s.ref_lp is not None:
            kl = compute_approx_kl(lp, s.ref_lp[i], kl_estimator=cfg.algo.kl_estimator)
            loss = loss + cfg.algo.kl_coef * aggregate(kl, b.mask, lc.agg, ctx.normalizer, self.world_size)
        if with_bonus:
            bonus = entropy_bonus(ent, b.mask, s.bonus_coef, lc.agg, ctx.normalizer, self.world_size)
            loss = loss + bonus
            s.add("loss/entropy_bonus", -bonus.item())
        # the normaliser already spans the whole mini-batch: no extra division by accumulation steps
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()
        s.add("loss/policy", out.loss.item())
        for k, v in out.metrics.items():
            s.add(f"loss/{k}" if not k.startswith("cov_") else f"cov/{k[4:]}", v)

    def _step_result(self, s: _Step, skipped: int, t0: float) -> dict[str, float]:
        """The step's metrics on this rank, reduced over its micro-batches."""
        result = {k: max(v) if k in MAX_METRICS else mean(v) for k, v in s.metrics.items()}
        # the loss is a share of the mini-batch mean on each rank: the sum over micro-batches is the step's loss
        for key in SUMMED_LOSSES:
            result[key] = mean(s.metrics.get(key, [])) * s.micro_per_mini / self.world_size
        result["loss/entropy_coef"] = s.bonus_coef
        result["train/skipped_steps"] = float(skipped)
        result["train/lr"] = float(self.engine.optimizer.param_groups[0]["lr"])
        result["time/train_actor"] = time.time() - t0
        result["train/tokens"] = float(sum(float(b.mask.sum()) for b in s.batches))
        return result

    # ------------------------------------------------------------------ weights out

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on CPU at rank 0 (every rank must call it: ZeRO-3 gathers the shards)."""
        import deepspeed  # actor-only imports (module docstring)

        # one parameter at a time: gathering a 32B model's shards at once would not fit on one GPU
        state = {}
        for name, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=self.cfg.actor.zero_stage == 3):
                if self.rank == 0:
                    state[name] = param.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None

    # collective weight sync (sync/group.py): rank 0 broadcasts to the rollout engines, ZeRO-3 ranks help gather

    def open_weight_sync(self, world_size: int, backend: str, timeout_s: float):
        """Every rank: prepare to send. Rank 0 also hosts the group's store and returns its SyncEndpoint."""
        if getattr(self, "weight_sender", None) is not None:
            self.weight_sender.close()
        self.weight_sender = WeightSender(self.engine.module, rank=self.rank, zero3=self.cfg.actor.zero_stage == 3)
        return self.weight_sender.open(ray.util.get_node_ip_address(), world_size, backend, timeout_s)

    def join_weight_sync(self) -> None:
        self.weight_sender.join()

    def broadcast_weights(self) -> int:
        return self.weight_sender.broadcast()

    def save_hf(self, path: str, source_model: str | None = None) -> None:
        """Rank 0 writes the weights and config; with `source_model`, also its tokenizer files, chat template and
        generation config (written here, on rank 0's node, which reads the model folder anyway)."""
        state = self.export_weights()
        if self.rank == 0:
            self.engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
            if source_model is not None:
                copy_tokenizer_and_generation_config(source_model, path)

    def save_checkpoint(self, path: str, tag: str) -> None:
        self.engine.save_checkpoint(path, tag=tag)
        # dropout draws from the global generators: keep this rank's, so a resumed run draws what this one would
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(path, tag, f"rng_rank{self.rank}.pt"))

    def load_checkpoint(self, path: str, tag: str) -> None:
        # DeepSpeed meets a missing checkpoint with a bare assert, or a log line and no load at all
        if not os.path.isdir(os.path.join(path, tag)) or self.engine.load_checkpoint(path, tag=tag)[0] is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {path}")
        rng_file = os.path.join(path, tag, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):  # absent in checkpoints written before the RNG was saved
            rng = torch.load(rng_file, weights_only=False)
            random.setstate(rng["python"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])

    def get_version(self) -> int:
        return self.version

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def device_report(self) -> tuple[str, bool]:
        """Where this rank runs and whether it sees a CUDA device there (the weight sync's backend follows it)."""
        return f"node {ray.util.get_node_ip_address()}", torch.cuda.is_available()

    def forward_log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """The trainer's log-probs of given responses (for the trainer-vs-vLLM check after a weight sync)."""
        from entropy_openrlhf.actors.forward import forward_log_probs  # actor-only imports (module docstring)

        b = self._seq_batch(prompt_ids, response_ids).to(self.engine.device)
        self.engine.eval()
        with torch.no_grad():
            lp, _ = forward_log_probs(self.engine, b)
        return [lp[i][b.mask[i].bool()].float().tolist() for i in range(len(prompt_ids))]


def _private_host_bytes() -> int:
    """This process's anonymous (private) resident memory now; 0 where /proc/self/smaps_rollup is missing."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def copy_tokenizer_and_generation_config(source: str, target: str) -> None:
    """What `save_pretrained` of a model leaves out: the tokenizer files (chat template included) and the
    generation config (eos ids, sampling defaults), taken from the model the run started from."""
    from transformers import AutoTokenizer, GenerationConfig  # actor-only imports (module docstring)

    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    try:
        GenerationConfig.from_pretrained(source).save_pretrained(target)
    except OSError:  # the source has none: save_pretrained already wrote one derived from the model config
        pass
