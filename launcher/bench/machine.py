"""The line a launcher benchmark's results name their machine with (committed results say where
and under what load they ran). The trainer's benchmarks have their own (trainer/bench/machine.py):
the launcher never imports the trainer."""

import os
import platform


def machine() -> str:
    """'<CPU model>, N CPUs, load average a, b, c; Python x.y.z'."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} CPUs, load average {load}; Python {platform.python_version()}"
