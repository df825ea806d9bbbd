"""Two Ray nodes on one machine, each in its own Linux network namespace and with its own /tmp.

Ray's `cluster_utils.Cluster` starts several raylets that share one address, one /tmp and one hostname, so a bug
that only shows when actors live on different hosts (a rendezvous on the wrong address, a file written to one
node's disk and read on another) passes there. Here each node is a network namespace with one end of a veth pair
on 198.18.0.0/24 (RFC 2544's range for tests; nothing is routed anywhere else, and the addresses exist only inside
the two namespaces) and a private mount namespace with fresh tmpfs on /tmp and /dev/shm. Everything else of the
host's filesystem is visible to both, and stands for the shared filesystem (NFS) of a real cluster.

Each node is held open by a `sleep` process living in both of its namespaces; commands run on a node through
`nsenter` into that process's namespaces. Teardown kills every process in the node's network namespace (Ray's
daemons, workers and the driver), by their own ids, and deletes the namespaces, which deletes the veth pair.
Nothing here runs `ray stop` or touches Ray processes outside the two namespaces.

Needs root, iproute2 (`ip netns`) and util-linux (`unshare`, `nsenter`); `missing_requirement()` names what is
missing so the tests can skip with that reason.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "eor"  # namespace and interface names: eor<pid><node>, e.g. eor12345a (interface names <= 15 chars)
SUBNET = "198.18.0"


def missing_requirement() -> str | None:
    """Why this machine cannot build the nodes (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2 / util-linux)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _kill_namespace(ns: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process in the network namespace, then SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + grace_s
        for pid in _namespace_pids(ns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        while _namespace_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _namespace_pids(ns):
            return


def remove_leftovers() -> list[str]:
    """Delete namespaces a killed test run left behind (its pid, in the name, is gone). Returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for name in re.findall(rf"^({PREFIX}(\d+)[a-z])\b", out, flags=re.M):
        ns, pid = name
        if not _pid_alive(int(pid)):
            _kill_namespace(ns, grace_s=2.0)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            removed.append(ns)
    return removed


@dataclass
class Node:
    letter: str  # "a", "b"
    ip: str
    ns: str
    ifname: str
    holder: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # what this node's Ray processes (and so its actors) get

    def command(self, *cmd: str, cwd: str) -> list[str]:
        """`cmd` run inside this node's network and mount namespaces, in `cwd`."""
        assert self.holder is not None
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", f"--wd={cwd}", "--", *cmd]

    def run(self, *cmd: str, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*cmd, cwd=cwd), env=env, capture_output=True, text=True, timeout=timeout)


class TwoNodes:
    """Node a (198.18.0.1, the Ray head) and node b (198.18.0.2, a worker). Use as a context manager."""

    def __init__(self, tmpfs_mb: int = 2048, keep: list[Path] = ()):
        """`keep`: folders under /tmp (the checkout, when CI clones it there) that stay visible on the nodes."""
        tag = f"{PREFIX}{os.getpid()}"
        self.nodes = [
            Node(letter, f"{SUBNET}.{i + 1}", f"{tag}{letter}", f"{tag}{letter}") for i, letter in enumerate("ab")
        ]
        self.tmpfs_mb = tmpfs_mb
        self.keep = [Path(p).resolve() for p in keep if Path(p).resolve().is_relative_to("/tmp")]

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def worker(self) -> Node:
        return self.nodes[1]

    def __enter__(self) -> TwoNodes:
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            _run("ip", "netns", "add", node.ns)
        _run("ip", "link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        for node in self.nodes:
            _run("ip", "-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", node.ifname)
            _run("ip", "-n", node.ns, "link", "set", node.ifname, "up")
            _run("ip", "-n", node.ns, "link", "set", "lo", "up")
        for node in self.nodes:
            self._mount(node)

    def _mount(self, node: Node) -> None:
        """Start the node's holder process: a private mount namespace with a fresh (empty) tmpfs on /tmp and
        /dev/shm, inside the node's network namespace."""
        # The host's /tmp is first bound under a small tmpfs on /mnt (this namespace's own), so the folders to keep
        # can be bound back at their own paths once the new tmpfs covers /tmp.
        rebind = "".join(
            f"mkdir -p {shlex.quote(str(p))} && "
            f"mount --bind {shlex.quote('/mnt/host-tmp/' + str(p.relative_to('/tmp')))} {shlex.quote(str(p))} && "
            for p in self.keep
        )
        mounts = (
            "mount -t tmpfs -o size=1m tmpfs /mnt && mkdir /mnt/host-tmp && mount --bind /tmp /mnt/host-tmp && "
            f"mount -t tmpfs -o size={self.tmpfs_mb}m tmpfs /tmp && {rebind}"
            f"mount -t tmpfs -o size={self.tmpfs_mb}m tmpfs /dev/shm && echo ready && exec sleep infinity"
        )
        # private mounts: the tmpfs is seen by this node's processes only, and goes when the last one exits
        node.holder = subprocess.Popen(
            ["ip", "netns", "exec", node.ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", mounts],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # a few mounts: a node that has not reported within 30 s will not
        answered, _, _ = select.select([node.holder.stdout], [], [], 30.0)
        line = node.holder.stdout.readline().strip() if answered else "no answer within 30 s"
        if line != "ready":
            why = node.holder.stderr.read() if node.holder.poll() is not None else line  # exited: its error
            raise RuntimeError(f"node {node.letter}: could not mount its private /tmp: {why}")

    def kill_node(self, node: Node) -> list[int]:
        """Lose `node` as a machine that stops at once would: SIGKILL every process in its network namespace (Ray's
        daemons, its workers, the holder of its private /tmp, which goes with it). Its address stays, so its peers
        are refused rather than left waiting. Returns the pids killed; raises if any is still alive after 10 s."""
        pids = _namespace_pids(node.ns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if node.holder is not None:
            node.holder.wait(timeout=10)  # reaped here, so it is not left a zombie
            node.holder = None
        deadline = time.monotonic() + 10.0
        while _namespace_pids(node.ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _namespace_pids(node.ns)
        if left:
            raise RuntimeError(f"node {node.letter}: processes {left} outlived SIGKILL for 10 s")
        return pids

    def rebuild_node(self, node: Node) -> None:
        """A replacement machine at the same address: fresh private /tmp and /dev/shm, no process yet (start Ray on
        it with `start_node`)."""
        assert node.holder is None, f"node {node.letter} is still up: kill_node first"
        self._mount(node)

    def close(self) -> None:
        for node in self.nodes:
            if subprocess.run(["ip", "netns", "pids", node.ns], capture_output=True).returncode == 0:
                _kill_namespace(node.ns)
            if node.holder is not None:
                node.holder.kill()
                node.holder.wait(timeout=10)
            subprocess.run(["ip", "netns", "del", node.ns], capture_output=True)

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster that still exist (for the test's own clean-up check)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [n.ns for n in self.nodes if re.search(rf"^{n.ns}\b", out, flags=re.M)]


def start_ray(
    cluster: TwoNodes,
    *,
    root: Path,
    base_env: dict[str, str],
    num_cpus: int,
    worker_env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> str:
    """`ray start` on both nodes as a cluster operator would: the head on node a, node b joining it, each with its
    own address, its interface for gloo and vLLM, and a custom resource naming it (`node_a`, `node_b`).
    `worker_env` is added to node b's environment only. Returns the head's GCS address."""
    for node in cluster.nodes:
        extra = worker_env if node is cluster.worker else None
        start_node(cluster, node, root=root, base_env=base_env, num_cpus=num_cpus, extra_env=extra, timeout_s=timeout_s)
    return f"{cluster.head.ip}:6379"


def start_node(
    cluster: TwoNodes,
    node: Node,
    *,
    root: Path,
    base_env: dict[str, str],
    num_cpus: int,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> None:
    """`ray start` on one node: the head on node a, or node b joining the head (also to bring a rebuilt node b
    back)."""
    ray = str(root / ".venv" / "bin" / "ray")
    node.env = {**base_env, "VLLM_HOST_IP": node.ip, "GLOO_SOCKET_IFNAME": node.ifname, **(extra_env or {})}
    common = [
        f"--node-ip-address={node.ip}", f"--num-cpus={num_cpus}", f'--resources={{"node_{node.letter}": 1}}',
        "--object-store-memory=400000000", "--disable-usage-stats",
    ]  # fmt: skip
    if node is cluster.head:
        cmd = [ray, "start", "--head", "--port=6379", "--include-dashboard=false", *common]
    else:
        cmd = [ray, "start", f"--address={cluster.head.ip}:6379", *common]
    proc = node.run(*cmd, cwd=str(root), env=node.env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start on node {node.letter} ({node.ip}) failed:\n{proc.stdout}\n{proc.stderr}")
