"""benchmarks/memory.py's sampler: a process that exits between two reads is skipped, not fatal; any other failure
is recorded, so the benchmark prints no peak it did not measure to the end."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # memory.py imports its neighbours
import memory  # noqa: E402 - needs the path above


def test_vm_hwm_of_a_gone_process_is_a_lookup_error():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        memory._vm_hwm(proc.pid)
    assert memory._vm_hwm(os.getpid()) > 0


def run_sampler(samples: int = 6, give_up_s: float = 60.0) -> memory.Sampler:
    """Run a sampler until it has taken `samples` samples (about 0.1 s on a quiet machine; a loaded one only makes it
    slower, so the test waits for the count, not for a fixed time) and check it is still sampling then."""
    child = subprocess.Popen(["sleep", str(give_up_s)])  # a descendant to sample
    sampler = memory.Sampler(interval=0.01)
    sampler.start()
    try:
        deadline = time.monotonic() + give_up_s
        while sampler.samples < samples and sampler.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.is_alive() and sampler.samples >= samples, (sampler.samples, sampler.error)
    finally:
        sampler.stop.set()
        sampler.join()
        child.kill()
        child.wait()
    return sampler


def test_a_process_gone_between_two_reads_is_skipped(monkeypatch):
    real, calls = memory._vm_hwm, []

    def vanishing(pid: int) -> float:
        calls.append(pid)
        if len(calls) == 2:  # the second process read in the first sample exits just before its status is read
            raise ProcessLookupError(pid)
        return real(pid)

    monkeypatch.setattr(memory, "_vm_hwm", vanishing)
    sampler = run_sampler()
    assert sampler.error is None and sampler.samples >= 6


def test_an_unexpected_failure_is_recorded(monkeypatch):
    def broken(pid: int) -> float:
        raise PermissionError("/proc is not readable")

    monkeypatch.setattr(memory, "_vm_hwm", broken)
    child = subprocess.Popen(["sleep", "5"])
    sampler = memory.Sampler(interval=0.01)
    sampler.start()
    sampler.join(timeout=60)  # it stops at its first sample; the timeout only stops a broken test from hanging
    child.kill()
    child.wait()
    assert not sampler.is_alive() and isinstance(sampler.error, PermissionError)
