"""Where the trainer reports its actors to run, on a real local Ray started on 127.0.0.1."""

import sys

import pytest

WRONG_GUESS = "192.0.2.99"  # TEST-NET-1 (RFC 5737): no host has it


@pytest.mark.timeout(300)
def test_actors_are_reported_on_the_node_s_own_address(ray_cluster):
    """The log line "actors started ... rollout on <addr>" names the address the node registered with Ray (here
    127.0.0.1), whatever the actor's process guesses its IP to be. The actors here guess wrong on purpose, as a
    process does when its guess follows the default route (the host's LAN address, an interface the node is not on)."""
    import ray

    from entropy_openrlhf.pipeline.placement import actor_node_addresses

    @ray.remote(num_cpus=0)
    class Plain:
        def __init__(self):
            import ray._private.services

            ray.util.get_node_ip_address = ray._private.services.get_node_ip_address = lambda *_: WRONG_GUESS

        def loaded(self, name: str) -> bool:
            return name in sys.modules

        def guess(self) -> str:
            return ray.util.get_node_ip_address()

    actors = [Plain.remote(), Plain.remote()]
    try:
        assert ray.get(actors[0].guess.remote(), timeout=120) == WRONG_GUESS
        where = actor_node_addresses({"rollout": actors[:1], "reward": actors[1:]}, timeout_s=120)
        assert where == {"rollout": ["127.0.0.1"], "reward": ["127.0.0.1"]}
        # asking did not make the actor import the trainer (a verifier worker would load torch with it)
        for module in ("entropy_openrlhf.pipeline.trainer", "entropy_openrlhf.pipeline.placement"):
            assert not ray.get(actors[1].loaded.remote(module), timeout=60), module
    finally:
        for a in actors:
            ray.kill(a)
