"""A benchmark's ratio is read beside the machine that measured it and how busy that machine was: every benchmark
that times something prints benchmarks/machine.py's one machine line, and that line names the CPU, the CPUs and the
load average before and after."""

import ast
import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours
import machine  # noqa: E402 - needs the path above

# long_responses.py measures memory, not time, and names its device (a GPU, or the CPU model) in its own header
NOT_TIMED = {"machine.py", "long_responses.py"}


def calls(path: Path) -> set[str]:
    """The names of the functions the module calls (f(...) and x.f(...))."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_the_line_names_the_cpu_the_cpus_and_both_loads(monkeypatch):
    monkeypatch.setattr(machine, "cpu_model", lambda: "Test CPU 9000")
    monkeypatch.setattr(os, "getloadavg", lambda: (2.345, 1.0, 0.5))
    line = machine.machine_line(0.04)
    assert line == f"machine: Test CPU 9000, {os.cpu_count()} CPUs; load average (1 min) before / after: 0.0 / 2.3"


def test_the_cpu_model_is_read_from_this_machine():
    assert machine.cpu_model().strip()


def test_every_timing_benchmark_prints_the_machine_line():
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in NOT_TIMED)
    assert len(scripts) >= 10  # the glob found the benchmarks
    missing = [p.name for p in scripts if "machine_line" not in calls(p)]
    assert not missing, f"benchmarks that print no machine line: {missing}"


def test_the_check_sees_a_script_without_the_line(tmp_path):
    script = tmp_path / "quiet.py"
    script.write_text("def main():\n    print('ratio: 1.0')\n")
    assert "machine_line" not in calls(script)
    script.write_text("from machine import machine_line\nprint(machine_line(0.1))\n")
    assert "machine_line" in calls(script)
