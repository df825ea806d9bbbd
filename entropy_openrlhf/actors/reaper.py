"""Processes a killed rollout engine leaves behind, found by pid and ended before its successor starts vLLM.

An engine is a Ray actor whose vLLM may run processes of its own: the engine core (VLLM_ENABLE_V1_MULTIPROCESSING=1,
the GPU default) and, with tensor parallelism, its worker processes. When Ray kills the actor (a deadline, a crash,
`RolloutGroup.shutdown`), it kills that one process; its children are re-parented and keep running, and vLLM's engine
core does not watch for its parent's death. On a GPU they keep their memory, so a restarted engine asking for 90 % of
the GPU fails.

So each engine records its process tree (pid and start time of each process, so that a reused pid is never taken
for one of them) in a file on its node once vLLM is up, under its Ray actor id, which a restart keeps. A restarted
engine runs on the same node (its placement group bundle), reads the file and kills what is left of the old tree
before it starts vLLM; `RolloutGroup.shutdown` does the same with a task on each engine's node after killing them.

A record is a snapshot: a process started after it (a compile worker, an NCCL helper) is not in it, and once the
recorded process that started it is gone, it hangs from no recorded process. So the tree is followed down again at
reap time, with every process found stopped (SIGSTOP) before its children are listed, so none can start another
unseen; and the engine marks its environment with its record key before vLLM starts (`mark_environment`), which
every process it starts inherits, so a process whose recorded ancestors are all gone is still found by its mark.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import ray

log = logging.getLogger(__name__)

MARK = "ENTROPY_OPENRLHF_ENGINE"  # environment variable: the record key of the engine whose tree a process is in
REAP_TIMEOUT_S = 60.0  # a SIGKILLed process is gone in milliseconds; a minute allows for a node under heavy load
_START_TIME_TOLERANCE_S = 0.05  # psutil derives start times from clock ticks: equal within this for one process


def record_dir() -> Path:
    """Node-local folder of the engines' process records (each node's own temporary folder)."""
    return Path(tempfile.gettempdir()) / "entropy_openrlhf_engines"


def process_tree(pid: int) -> list[tuple[int, float]]:
    """(pid, start time) of `pid` and every process below it, parents first."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    tree = []
    for p in procs:
        try:
            tree.append((p.pid, p.create_time()))
        except psutil.NoSuchProcess:  # ended while listed: nothing to reap
            pass
    return tree


def mark_environment(key: str) -> None:
    """Mark this process's environment with `key`, inherited by every process it starts from now on."""
    os.environ[MARK] = key


def marked_processes(key: str) -> list[tuple[int, float]]:
    """(pid, start time) of every process on this node whose environment carries `key` (mark_environment)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == key:
                found.append((p.pid, p.create_time()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):  # gone, or not ours to read
            pass
    return found


def write_record(key: str, tree: list[tuple[int, float]]) -> Path:
    """Keep `tree` under `key` on this node (replacing an earlier record); return the file."""
    folder = record_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tree))
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def _same_process(pid: int, started: float) -> psutil.Process | None:
    """The live process `pid` if it is still the one that started at `started`, else None (gone, or a reused pid)."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - started) > _START_TIME_TOLERANCE_S or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.NoSuchProcess:
        return None


def reap(tree: list[tuple[int, float]], what: str, timeout_s: float = REAP_TIMEOUT_S, key: str = "") -> list[int]:
    """SIGKILL every process of `tree` still alive, the processes marked with `key` (when given) and every process
    below any of them as it is at reap time, and wait until all are gone. Returns the pids killed; raises
    TimeoutError naming `what` and the pids still alive after `timeout_s`."""
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # never this process nor its ancestors
    roots = tree + (marked_processes(key) if key else [])
    targets: dict[int, psutil.Process] = {}
    for pid, started in roots:
        p = _same_process(pid, started)
        if p is not None and p.pid not in spared:
            targets[p.pid] = p
    # Stop each process before listing its children, and list again until no new one appears: a running process
    # could start a child between the listing and the kill, and that child would be missed.
    frontier = list(targets.values())
    while frontier:
        for p in frontier:
            _signal(p, signal.SIGSTOP)
        found = []
        for p in frontier:
            try:
                children = p.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for child in children:
                if child.pid not in targets and child.pid not in spared:
                    targets[child.pid] = child
                    found.append(child)
        frontier = found
    for p in targets.values():
        _signal(p, signal.SIGKILL)  # a stopped process dies of SIGKILL as a running one does
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, p in targets.items() if _still_running(p)]
        if not alive:
            return sorted(targets)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: processes {alive} were still alive {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.05)


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)  # psutil checks the pid still names this process first
    except psutil.NoSuchProcess:
        pass


def _still_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # a zombie holds no memory, only its pid
    except psutil.NoSuchProcess:
        return False


def reap_recorded(key: str, what: str, timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """Reap the tree recorded under `key` on this node and the processes marked with `key`, and drop the record;
    return the pids killed."""
    path = record_dir() / f"{key}.json"
    try:
        tree = [(int(pid), float(started)) for pid, started in json.loads(path.read_text())]
    except FileNotFoundError:  # killed before it wrote its record: its marked processes are still found
        tree = []
    killed = reap(tree, what, timeout_s, key=key)
    path.unlink(missing_ok=True)
    return killed


@ray.remote(num_cpus=0, max_retries=0)
def reap_recorded_task(keys: list[str], what: str, timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """`reap_recorded` for each key, run on the node that holds the records (NodeAffinitySchedulingStrategy)."""
    killed: list[int] = []
    for key in keys:
        killed += reap_recorded(key, f"{what} (actor {key})", timeout_s)
    return killed
