"""Ending what a killed engine leaves behind (actors/reaper.py), on real process trees: a parent that starts a child
and is then SIGKILLed, as Ray kills an engine actor whose vLLM engine core runs in a child process."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from entropy_openrlhf.actors import reaper

# a parent that starts a long-sleeping child, prints its pid, and sleeps itself
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def orphan():
    """(record of the tree, the child's pid) after the parent was SIGKILLed: the child lives on, re-parented."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    tree = reaper.process_tree(parent.pid)
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        time.sleep(0.2)
        assert running(child_pid), "the child should outlive its parent's SIGKILL (the problem being solved)"
        yield tree, child_pid
    finally:
        for pid, _ in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_tree_lists_the_process_and_its_children_with_start_times():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        tree = reaper.process_tree(parent.pid)
        assert [pid for pid, _ in tree] == [parent.pid, child_pid]
        assert all(started > 0 for _, started in tree)
    finally:
        reaper.reap(reaper.process_tree(parent.pid), "test cleanup")
        parent.wait(timeout=30)


def test_a_killed_parent_s_orphaned_child_is_ended_by_pid(orphan):
    tree, child_pid = orphan
    killed = reaper.reap(tree, "a test engine")
    assert killed == [child_pid]  # the parent was already gone
    assert not running(child_pid)


def test_a_record_written_on_the_node_is_reaped_and_dropped(orphan, tmp_path, monkeypatch):
    tree, child_pid = orphan
    monkeypatch.setattr(reaper, "record_dir", lambda: tmp_path)
    path = reaper.write_record("actor123", tree)
    assert path.is_file()
    assert reaper.reap_recorded("actor123", "a restarted test engine") == [child_pid]
    assert not running(child_pid) and not path.exists()
    assert reaper.reap_recorded("actor123", "again") == []  # nothing recorded: nothing to do


def test_a_reused_pid_is_not_taken_for_a_recorded_process():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = psutil.Process(other.pid).create_time()
        assert reaper.reap([(other.pid, started - 100.0)], "a stale record") == []  # same pid, another process
        assert running(other.pid)
    finally:
        other.kill()
        other.wait(timeout=30)


def test_the_reaping_process_never_kills_itself_nor_its_own_children():
    me = psutil.Process()
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as a test runner's services
    try:
        assert reaper.reap([(me.pid, me.create_time())], "a record of this very process") == []
        assert running(mine.pid)
    finally:
        mine.kill()
        mine.wait(timeout=30)


def test_processes_that_will_not_die_fail_in_time_naming_them(orphan, monkeypatch):
    tree, child_pid = orphan
    monkeypatch.setattr(reaper, "_still_running", lambda p: True)  # as if SIGKILL had no effect (a hung D state)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"^a stuck engine: processes \[{child_pid}\] were still alive 1 s after"):
        reaper.reap(tree, "a stuck engine", timeout_s=1.0)
    assert time.monotonic() - t0 < 10


# prints a line once its interpreter runs, then sleeps. Popen returns when exec closes the child's close-on-exec
# pipe, which the kernel does before it lays out the new program's environment: until that line is read,
# /proc/PID/environ can still be empty and the mark unseen (CI caught that window once).
ANNOUNCED_SLEEPER = "print('up', flush=True); import time; time.sleep(600)"


# a child that, once told to (a line on stdin), starts a grandchild, prints its pid, and then either sleeps or exits
LATE_SPAWNER = (
    "import subprocess, sys, time\n"
    "sys.stdin.readline()\n"
    f"grandchild = subprocess.Popen([sys.executable, '-c', {ANNOUNCED_SLEEPER!r}], stdout=subprocess.PIPE)\n"
    "grandchild.stdout.readline()\n"  # its environment, and so its mark, is readable from here on
    "print(grandchild.pid, flush=True)\n"
    "time.sleep(600 if sys.argv[1] == 'stay' else 0)\n"
)


@pytest.mark.parametrize("child_exits", [False, True])
def test_a_grandchild_started_after_the_record_is_reaped(child_exits, tmp_path, monkeypatch):
    """The record is a snapshot: a grandchild started after it is found by following the tree down at reap time
    while its parent lives, and by the engine's environment mark once its parent is gone (re-parented to init)."""
    monkeypatch.setattr(reaper, "record_dir", lambda: tmp_path)
    key = f"engine-under-test-{os.getpid()}-{child_exits}"
    env = {**os.environ, reaper.MARK: key}  # what mark_environment leaves to every process the engine starts
    child = subprocess.Popen(
        [sys.executable, "-c", LATE_SPAWNER, "exit" if child_exits else "stay"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    grandchild_pid = None
    try:
        reaper.write_record(key, reaper.process_tree(child.pid))  # only the child: the grandchild is not born yet
        child.stdin.write("go\n")
        child.stdin.flush()
        grandchild_pid = int(child.stdout.readline())
        if child_exits:
            child.wait(timeout=30)
            assert running(grandchild_pid), "the grandchild should outlive its parent (the case being solved)"
        killed = reaper.reap_recorded(key, "a test engine")
        assert grandchild_pid in killed and not running(grandchild_pid)
        assert (child.pid in killed) is not child_exits
        assert not running(child.pid)
    finally:
        child.kill()
        child.wait(timeout=30)
        if grandchild_pid is not None and running(grandchild_pid):
            os.kill(grandchild_pid, signal.SIGKILL)


def test_marked_processes_are_found_and_unmarked_ones_are_not():
    key = f"mark-under-test-{os.getpid()}"
    sleeper = [sys.executable, "-c", ANNOUNCED_SLEEPER]
    marked = subprocess.Popen(sleeper, env={**os.environ, reaper.MARK: key}, stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen(sleeper, stdout=subprocess.PIPE, text=True)
    try:
        assert marked.stdout.readline() == "up\n" and plain.stdout.readline() == "up\n"
        assert [pid for pid, _ in reaper.marked_processes(key)] == [marked.pid]
        assert reaper.reap([], "marked only", key=key) == [marked.pid]
        assert not running(marked.pid) and running(plain.pid)
    finally:
        for p in (marked, plain):
            p.kill()
            p.wait(timeout=30)
