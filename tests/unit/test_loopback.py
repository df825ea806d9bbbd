"""What decides whether a local run is reachable from other machines: the store that hosts the ranks' rendezvous
(rendezvous.py) and the check that stops a local Ray whose processes listen beyond loopback (cluster.py)."""

import socket
from collections import namedtuple

import psutil
import pytest

from entropy_openrlhf import cluster
from entropy_openrlhf.rendezvous import connect_store, deepspeed_pg_timeout, serve_store

Addr = namedtuple("Addr", "ip port")
Conn = namedtuple("Conn", "fd family type laddr raddr status pid")


def listeners_of_this_process() -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]


def test_the_rendezvous_store_listens_on_its_host_only_and_serves_clients():
    store = serve_store("127.0.0.1", 0, 2, timeout_s=10)
    assert store.port > 0
    assert ("127.0.0.1", store.port) in listeners_of_this_process()
    assert not [ip for ip, port in listeners_of_this_process() if port == store.port and ip != "127.0.0.1"]
    client = connect_store("127.0.0.1", store.port, 2, timeout_s=10)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"


def test_a_taken_rendezvous_port_names_eaddrinuse():
    # PolicyGroup retries on another port when the actor's error says EADDRINUSE
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError, match="EADDRINUSE"):
            serve_store("127.0.0.1", held.getsockname()[1], 1, timeout_s=5)


def test_collectives_keep_deepspeeds_default_timeout():
    """init_default_group computes DeepSpeed's default timeout instead of importing DeepSpeed: the two agree."""
    from deepspeed.constants import default_pg_timeout

    assert deepspeed_pg_timeout() == default_pg_timeout


@pytest.mark.parametrize(
    ("ip", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True), ("127.0.0.53", True),
     ("0.0.0.0", False), ("::", False), ("192.0.2.2", False), ("::ffff:192.0.2.2", False), ("fe80::1%eth0", False)],
)  # fmt: skip
def test_loopback_addresses(ip, loopback):
    assert cluster._is_loopback(ip) is loopback


def test_exposed_listeners_are_the_tree_s_listening_sockets_beyond_loopback(monkeypatch):
    me = psutil.Process()
    tcp, udp = socket.SOCK_STREAM, socket.SOCK_DGRAM
    conns = [
        Conn(3, socket.AF_INET, tcp, Addr("127.0.0.1", 1001), (), psutil.CONN_LISTEN, me.pid),
        Conn(4, socket.AF_INET6, tcp, Addr("::", 1002), (), psutil.CONN_LISTEN, me.pid),  # every interface
        Conn(5, socket.AF_INET, tcp, Addr("192.0.2.2", 1003), Addr("192.0.2.9", 80), psutil.CONN_ESTABLISHED, me.pid),
        Conn(6, socket.AF_INET, udp, Addr("0.0.0.0", 1004), (), psutil.CONN_NONE, me.pid),  # waits for anyone
        Conn(7, socket.AF_INET, udp, Addr("192.0.2.2", 1005), Addr("192.0.2.9", 53), psutil.CONN_NONE, me.pid),
        Conn(8, socket.AF_INET, tcp, Addr("0.0.0.0", 1006), (), psutil.CONN_LISTEN, 999_999_999),  # not ours
    ]
    monkeypatch.setattr(psutil, "net_connections", lambda kind: conns)
    name = me.name()
    assert cluster.exposed_listeners([me]) == sorted(
        [f"{name} ({me.pid}) [::]:1002", f"{name} ({me.pid}) 0.0.0.0:1004"]
    )
    with pytest.raises(RuntimeError, match=r"beyond loopback with authentication off.*\[::\]:1002"):
        cluster.check_loopback_only([me])
