"""The line a benchmark's results name their machine with (committed results say where they ran)."""

import os
import platform


def machine() -> str:
    """'Linux x86_64, <CPU model>, N CPUs'."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPUs"
