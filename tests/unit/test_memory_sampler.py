"""benchmarks/memory.py's sampler: a process that exits between two reads is skipped, not fatal; any other failure
is recorded, so the benchmark prints no peak it did not measure to the end."""

import os
import subprocess
import time

import pytest

from benchmarks import memory


def test_vm_hwm_of_a_gone_process_is_a_lookup_error():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        memory._vm_hwm(proc.pid)
    assert memory._vm_hwm(os.getpid()) > 0


def run_sampler(seconds: float = 0.5) -> memory.Sampler:
    child = subprocess.Popen(["sleep", "5"])  # a descendant to sample
    sampler = memory.Sampler(interval=0.01)
    sampler.start()
    try:
        time.sleep(seconds)
        assert sampler.is_alive()
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
    assert sampler.error is None and sampler.samples > 5


def test_an_unexpected_failure_is_recorded(monkeypatch):
    def broken(pid: int) -> float:
        raise PermissionError("/proc is not readable")

    monkeypatch.setattr(memory, "_vm_hwm", broken)
    child = subprocess.Popen(["sleep", "5"])
    sampler = memory.Sampler(interval=0.01)
    sampler.start()
    sampler.join(timeout=10)
    child.kill()
    child.wait()
    assert not sampler.is_alive() and isinstance(sampler.error, PermissionError)
