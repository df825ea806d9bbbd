"""The driver-side base of every actor group: its placement group, spawning its actors, calling a method on all of
them (in one order, with a deadline), and shutting them down.

Modelled on OpenRLHF's `PPORayActorGroup` (openrlhf/trainer/ray/launcher.py): one bundle per actor in one placement
group, so that the actors of a group are placed together and no two groups share a GPU. Groups whose ranks form a
torch process group (the policy, the ZeRO-3 reference) meet at a rendezvous address on rank 0's node, picked by a
small task placed there; `_start_ranks` retries with a new port when another process took the picked one.

`call_all` runs one method on every rank, as OpenRLHF's `RayActorGroup.async_run_method` does (same arguments to
each; `call_each` gives each rank its own). It adds what ranks that meet in collectives need of the driver: one
submission order on every rank, and a wait that fails as soon as one rank does, or when a deadline passes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from entropy_openrlhf.ray_waits import wait_placement, wait_started

log = logging.getLogger(__name__)

RENDEZVOUS_ATTEMPTS = 3  # ports picked for the ranks' rendezvous before a taken one fails the start


def free_port(host: str) -> int:
    """A port free on `host`, the one address the rendezvous store will bind (never the wildcard)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
def _rendezvous_address(local: bool) -> tuple[str, int]:
    """Rank 0's node address and a free port there. MASTER_ADDR counts only on a local cluster (127.0.0.1): raylets
    on a real cluster may have inherited one (SLURM sets it) that names another host."""
    host = os.environ["MASTER_ADDR"] if local and os.environ.get("MASTER_ADDR") else ray.util.get_node_ip_address()
    return host, free_port(host)


class ActorGroup:
    """A group of Ray actors, one per bundle of its own placement group. Subclasses spawn their actors with
    `_start` (or `_start_ranks`, when the ranks meet in a process group) and add the calls the driver makes."""

    def __init__(self, count: int, bundle: dict[str, float], what: str, placement_timeout_s: float):
        """Places `count` bundles like `bundle` together; fails naming `what` and the free resources when the
        cluster cannot place them within `placement_timeout_s`; `what` names the group in `call_all`'s errors
        too."""
        self.actors: list = []
        self.size = count
        self.what = what
        self._submit = threading.Lock()  # see call_each_async
        self.pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
        wait_placement(self.pg, what, placement_timeout_s)

    def on_bundle(self, i: int) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy that puts an actor (or task) on bundle `i` of the group."""
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)

    def call_all(self, method: str, *args: Any, timeout_s: float | None = None, what: str = "") -> list:
        """`method(*args)` on every rank; their answers, in rank order. Raises the first rank's error as soon as it
        comes, and TimeoutError naming the group, the method and the ranks still running once `timeout_s` has
        passed (None: no deadline, for calls nothing bounds, such as a training step). `what` adds words to that
        message: what the call waits for, or which flag sets the deadline."""
        return self.wait(self.call_all_async(method, *args), method, timeout_s=timeout_s, what=what)

    def call_all_async(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """`call_all` without the wait: one ref per rank, for a caller that waits on them with others."""
        return self.call_each_async(method, [args] * len(self.actors))

    def call_each(
        self, method: str, per_rank: Sequence[tuple], *, timeout_s: float | None = None, what: str = ""
    ) -> list:
        """`call_all` with arguments of each rank's own: rank r runs `method(*per_rank[r])` (a batch dealt out)."""
        return self.wait(self.call_each_async(method, per_rank), method, timeout_s=timeout_s, what=what)

    def call_each_async(self, method: str, per_rank: Sequence[tuple]) -> list[ray.ObjectRef]:
        """Submit `method(*per_rank[r])` to every rank r. Calls of several driver threads (the trainer's step and
        sync, the rollout group re-exporting weights for a restarted engine) must reach every rank in the same
        order: ranks meet in collectives (ZeRO-3 gathers, DeepSpeed's all-reduce), so rank 0 running A then B
        while rank 1 runs B then A would deadlock. Submitting each call to all ranks under one lock keeps the
        order the same everywhere (Ray runs one caller's calls to an actor in the order they were submitted)."""
        if len(per_rank) != len(self.actors):
            raise ValueError(f"{self.what}: {method} got arguments for {len(per_rank)} of {len(self.actors)} ranks")
        with self._submit:
            return [getattr(actor, method).remote(*args) for actor, args in zip(self.actors, per_rank)]

    def wait(self, refs: list[ray.ObjectRef], method: str, *, timeout_s: float | None = None, what: str = "") -> list:
        """The answers of one call's refs (one per rank), as `call_all` waits for them. A rank that fails raises at
        once: its peers would otherwise wait in a collective for it until their own timeout, and so would we."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                running = [r for r, ref in enumerate(refs) if ref in pending]
                raise TimeoutError(
                    f"{self.what}: {method} did not answer within {timeout_s:g} s{f' ({what})' if what else ''}; "
                    f"rank(s) {running} of {len(refs)} still running"
                )
            ray.get(ready)  # re-raises the rank's own error
        return ray.get(refs)

    def _start(self, spawn: Callable[[int], Any], ready: str, what: str, timeout_s: float) -> list:
        """Spawn actor i with `spawn(i)` for every bundle, then wait for each one's `ready` call (which surfaces
        start-up errors) at most `timeout_s`; returns what they answered. On failure the group is shut down."""
        self.actors = [spawn(i) for i in range(self.size)]
        try:
            return wait_started([getattr(a, ready).remote() for a in self.actors], what, timeout_s)
        except Exception:
            self._shutdown_after_failed_start()
            raise

    def _start_ranks(
        self,
        spawn: Callable[[int, str, int], Any],
        ready: str,
        what: Callable[[str], str],
        timeout_s: float,
        *,
        role: str,
        local: bool,
    ) -> list:
        """`_start` for ranks that meet at (master_addr, master_port) on rank 0's node: `spawn(i, addr, port)`;
        `what(where)` names the group in errors, `where` being the rendezvous. `role` names it in the rendezvous
        messages; `local`: the driver started this Ray itself (everything on 127.0.0.1)."""
        # The port is free when picked but bound only when rank 0 starts: on a busy node another process can take
        # it in between (seen with tests and a run side by side), so a lost port means new actors on a new one.
        attempt = 1
        while True:
            # the rendezvous lives on rank 0's node, which need not be the driver's on a multi-node cluster
            master_addr, master_port = wait_started(
                _rendezvous_address.options(scheduling_strategy=self.on_bundle(0)).remote(local),
                f"the {role}'s rendezvous address task",
                timeout_s,
            )
            self.actors = [spawn(i, master_addr, master_port) for i in range(self.size)]
            try:
                # the ranks meet at master_addr:master_port inside their __init__
                where = f", rendezvous at {master_addr}:{master_port}"
                return wait_started([getattr(a, ready).remote() for a in self.actors], what(where), timeout_s)
            except ray.exceptions.RayActorError as e:
                if "EADDRINUSE" not in str(e) or attempt == RENDEZVOUS_ATTEMPTS:
                    self._shutdown_after_failed_start()
                    raise
                for actor in self.actors:
                    ray.kill(actor)
                print(f"[entropy-openrlhf] {role} rendezvous port {master_port} was taken; retrying on another")
                attempt += 1
            except Exception:
                self._shutdown_after_failed_start()
                raise

    def _shutdown_after_failed_start(self) -> None:
        try:
            self.shutdown()
        except Exception as e:  # noqa: BLE001 - the start's own error is the one to raise
            log.warning("cleaning up after the failed start: %s", e)

    def shutdown(self) -> None:
        """Kill the actors and free the placement group."""
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)
