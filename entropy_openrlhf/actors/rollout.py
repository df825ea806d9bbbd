"""The rollout group: the driver's handle on `num_engines` vLLM engines (RolloutActor, engine.py). It splits
prompts across the engines, keeps the results in prompt order and recovers engines that die or hang.

Weights reach the engines through the run's weight sync (entropy_openrlhf/sync/), which the group does not know
the method of: the sync attaches itself (`weight_sync`), sets `version` once every engine holds new weights, and is
called back (`WeightSync.engine_back`) when an engine comes back from a restart with the initial model.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from entropy_openrlhf.actors.engine import WORKER_EXTENSION, RolloutActor, RolloutEngine, StaleEngineError
from entropy_openrlhf.actors.engine_settings import engine_tuning_kwargs, prompt_seed
from entropy_openrlhf.actors.group import ActorGroup
from entropy_openrlhf.actors.reaper import REAP_TIMEOUT_S, reap_recorded_task
from entropy_openrlhf.config import Config
from entropy_openrlhf.samples import PromptItem, Sample
from entropy_openrlhf.sync.factory import resolve_method

if TYPE_CHECKING:  # annotations only: evaluation and the benchmarks run engines without a weight sync
    from entropy_openrlhf.sync.base import WeightSync

# the engine's names, where they always were
__all__ = [
    "WORKER_EXTENSION",
    "RolloutActor",
    "RolloutEngine",
    "RolloutGroup",
    "StaleEngineError",
    "engine_tuning_kwargs",
    "prompt_seed",
]

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


# Engine faults: a dead engine process (segfault, OOM kill, lost node) is restarted by Ray up to this many times;
# the group then reloads the current weights into it and generates its prompts again.
ENGINE_MAX_RESTARTS = 3
ENGINE_RESTART_TIMEOUT_S = 300.0  # a restart loads the model and starts vLLM: minutes for a large model
GENERATE_TIMEOUT_S = 3600.0  # --rollout.generate_timeout_s's default, for groups built without a config


def _split(items: list, parts: int) -> list[list]:
    """Contiguous, nearly equal chunks (some empty when there are fewer items than parts)."""
    size = math.ceil(len(items) / parts) if items else 0
    return [items[i * size : (i + 1) * size] for i in range(parts)]


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
        generate_timeout_s: float = GENERATE_TIMEOUT_S,
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
        self.weight_sync: WeightSync | None = None  # the run's sync attaches itself: it reloads restarted engines
        bundle = {"CPU": num_cpus_per_engine, **(custom_resources or {})}
        if num_gpus_per_engine:
            bundle["GPU"] = num_gpus_per_engine
        # Fail with a clear message instead of waiting forever for resources the cluster does not have.
        super().__init__(num_engines, bundle, f"the rollout group ({num_engines} engine(s) of {bundle})",
                         placement_timeout_s)  # fmt: skip
        # The policy version every engine must hold (set by the weight sync); a restarted engine is brought back to it.
        self.version = 0
        self.restarts = 0  # engines that died (and Ray restarted) so far
        # A generate call that runs longer than this gets its engine killed, which turns a hang into a death the
        # restart path below already handles (the config refuses 0: every call has a deadline).
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
            # the adapter sync: the engines serve the policy's LoRA adapter on the base (sync/adapter.py)
            lora_rank=cfg.actor.lora_rank
            if resolve_method(cfg.sync.method, cfg.actor.lora_rank > 0) == "adapter"
            else 0,
            # --rollout.mode stream|partial: token-id requests one sample at a time (actors/engine_stream.py)
            streaming=r.mode != "batch",
            partial_kv=r.partial_kv,
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
        poll_s = min(5.0, self.generate_timeout_s / 4)
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
            self.recover(i, why, died)
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

    def recover(self, i: int, why: str, died: bool, reload: bool = True) -> None:
        """Wait until Ray has restarted engine `i`, then have the weight sync bring it back: load the current
        weights into it (a restarted engine starts from the initial model, and would otherwise tag old-policy samples
        with the new version); the collective sync also rebuilds its broadcast group around the new process before its
        next broadcast. `reload` False: the caller is about to send every engine new weights anyway."""
        then = f"reloading policy version {self.version} into it" if reload else "the sync that follows loads it"
        log.warning("rollout engine %d %s: %s once it answers", i, why, then)
        t0 = time.monotonic()
        engine_version = self._wait_answering(i, why)
        # a restart shows as a dead call, or as an engine back at version 0 (it restarted between two calls)
        restarted = died or (engine_version == 0 and self.version != 0)
        self.restarts += int(restarted)
        if self.weight_sync is not None:
            self.weight_sync.engine_back(i, why, engine_version, restarted, reload)
        elif reload and engine_version != self.version:
            raise RuntimeError(f"rollout engine {i} {why}; without a weight sync there is no copy of policy version "
                               f"{self.version} to reload")  # fmt: skip
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

    def sequence_log_probs(
        self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]
    ) -> list[list[float]]:
        """The engines' log-probs of each response token (a check of the weights they hold: benchmarks, tests).
        Raises TimeoutError naming the engines still running after `generate_timeout_s`."""
        pairs = list(zip(prompt_token_ids, response_token_ids, strict=True))
        calls = {
            actor.sequence_log_probs.remote([p for p, _ in chunk], [r for _, r in chunk]): i
            for i, (actor, chunk) in enumerate(zip(self.actors, _split(pairs, len(self.actors))))
            if chunk
        }
        _, running = ray.wait(list(calls), num_returns=len(calls), timeout=self.generate_timeout_s)
        if running:
            raise TimeoutError(
                f"rollout engine(s) {sorted(calls[r] for r in running)} did not return sequence log-probs within "
                f"{self.generate_timeout_s:g} s (generate_timeout_s)"
            )
        return [lp for part in ray.get(list(calls)) for lp in part]

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
