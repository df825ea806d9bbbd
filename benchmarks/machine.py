"""What every benchmark prints about the machine it ran on (imported by the scripts beside it): a ratio is only
read beside the machine that measured it and how busy that machine was."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (on other systems, what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(load_before: float) -> str:
    """The line a benchmark prints with its results: the CPU model, the CPUs, and the 1-minute load average before the
    measurement (`load_before`, read by the caller when it began) and now."""
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs; load average (1 min) before / after: "
        f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    )
