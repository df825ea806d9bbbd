"""Waiting on Ray with deadlines: a placement group, actors' start-up calls, killed actors. A timeout names what was
waited for and the cluster's free resources, instead of waiting forever in silence.

Apart from cluster.py because the verifier workers import it (actors/reward.py): nothing here needs torch.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import remove_placement_group


def _free_resources() -> str:
    free = ray.available_resources()
    return ", ".join(f"{k} {v:g}" for k, v in sorted(free.items()) if not k.startswith(("node:", "memory", "object")))


def wait_placement(pg, what: str, timeout_s: float) -> None:
    """Wait for a placement group; on timeout remove it and fail naming the group and the cluster's free resources
    (a group that cannot be placed would otherwise wait forever, silently)."""
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise TimeoutError(
            f"{what}: Ray could not place it within {timeout_s:.0f} s (--ray.placement_timeout_s); free resources: "
            f"{_free_resources()}; `ray status` shows what holds the rest"
        )


def wait_started(refs: list, what: str, timeout_s: float) -> list:
    """ray.get of actors' start-up calls with a deadline; on timeout the error names the group."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"{what} did not start within {timeout_s:.0f} s (--ray.start_timeout_s): loading the model, or waiting "
            f"for a resource; free resources: {_free_resources()}"
        ) from None


def wait_dead(actors: list, timeout_s: float) -> int:
    """After `ray.kill`, which only asks Ray to kill: wait until every actor is gone (a call to it fails with
    RayActorError), at most `timeout_s`. Returns how many still answered at the deadline."""
    pending = list(actors)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        refs = [a.__ray_call__.remote(lambda _actor: None) for a in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.1, deadline - time.monotonic()))
        alive = []
        for actor, ref in zip(pending, refs):
            if ref not in ready:
                alive.append(actor)  # no answer yet: still shutting down, or its node is unreachable
                continue
            try:
                ray.get(ref)
                alive.append(actor)  # answered: not killed yet
            except ray.exceptions.RayActorError:
                pass
        pending = alive
        if pending:
            time.sleep(0.2)
    return len(pending)
