"""Where a run's actors are: the Ray node of each actor, and the address each node registered with Ray.

The trainer logs it at start ("actors started ... rollout on <address>") and its node watch reads it (faults.py).
"""

from __future__ import annotations

import ray

from entropy_openrlhf.ray_waits import wait_started


def actor_node_ids(groups: dict[str, list], timeout_s: float = 60.0) -> dict[str, list[str]]:
    """The Ray node id of each actor, by group, in the order given."""
    # Asked through Ray's generic actor call, so no actor class needs a method for it. A lambda travels by value:
    # a function of this module would make every actor import the trainer (and torch, in the verifier workers).
    refs = {name: [a.__ray_call__.remote(lambda _actor: ray.get_runtime_context().get_node_id()) for a in actors]
            for name, actors in groups.items()}  # fmt: skip
    ids = wait_started([r for rs in refs.values() for r in rs], "the actors' node ids", timeout_s)
    out, i = {}, 0
    for name, rs in refs.items():
        out[name], i = ids[i : i + len(rs)], i + len(rs)
    return out


def actor_node_addresses(groups: dict[str, list], timeout_s: float = 60.0) -> dict[str, list[str]]:
    """The address of the node each actor runs on, by group, in the order given.

    Each actor reports its Ray node id, and the address is the one that node registered with Ray (NodeManagerAddress
    in `ray.nodes()`): the fact Ray schedules by. The process's own guess of its IP (`get_node_ip_address`) can name
    another interface, such as the host's LAN address on a Ray started on 127.0.0.1."""
    return addresses_by_group(actor_node_ids(groups, timeout_s))


def addresses_by_group(ids: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each group's Ray node ids as the addresses those nodes registered (`node_addresses`)."""
    nodes = ray.nodes()
    return {name: node_addresses(node_ids, nodes) for name, node_ids in ids.items()}


def node_addresses(node_ids: list[str], nodes: list[dict]) -> list[str]:
    """Each Ray node id's registered address, from `ray.nodes()`'s records (NodeID -> NodeManagerAddress)."""
    by_id = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
    unknown = [i for i in node_ids if i not in by_id]
    if unknown:
        raise RuntimeError(f"Ray node {unknown[0]} is not among the cluster's {len(by_id)} node(s) (ray.nodes())")
    return [by_id[i] for i in node_ids]
