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


def cpu_ticks() -> tuple[int, int]:
    """(stolen, all) CPU ticks of the whole machine since boot, from /proc/stat's first line.
    Stolen ticks are those a virtual machine's CPU was ready to run and the hypervisor ran
    someone else's: on a shared host they slow every process of a benchmark at random, which
    the load average does not show. (0, 0) where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def stolen_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of CPU time stolen between two cpu_ticks() readings (0 where unknown)."""
    stolen, total = after[0] - before[0], after[1] - before[1]
    return stolen / total if total > 0 else 0.0
