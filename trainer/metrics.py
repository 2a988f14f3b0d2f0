"""Per-step metrics: the JSONL record, the human log line, MFU, memory, goodput.

One `kitchen.v1.Progress` per logged step goes to `<run_dir>/metrics.jsonl` (its format and
reader: protos/progress_log.py) and to the launcher when there is one. Values are averaged over
the steps since the previous log line, so nothing between two lines is lost.
"""

import os
import resource
import time
from pathlib import Path

import torch

from protos import progress_log
from trainer.sizing import flops

# sdc_rollback: progress thrown away when data-parallel replicas disagreed (trainer/health/).
BADPUT = (
    "startup",
    "data",
    "checkpoint_save",
    "checkpoint_restore",
    "lost",
    "eval",
    "sdc_rollback",
)


def process_start_time() -> float:
    """When this process started (wall clock), so start-up badput includes imports."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + start / ticks
    except (OSError, ValueError, IndexError):
        return time.time()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or on a CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Goodput:
    """Productive training time over wall time since the job started, across restarts.

    Badput: start-up, data loading, checkpoint save, checkpoint restore, progress lost (steps
    redone after a restart or rollback, updates skipped by the loss guard), evaluation, and
    steps rolled back because replicas disagreed (silent data corruption).
    """

    def __init__(self, started: float):
        self.started = started
        self.earlier_wall = 0.0  # wall time of earlier attempts, up to their checkpoint
        self.seconds = dict.fromkeys(("productive", *BADPUT), 0.0)
        self.since_checkpoint = 0.0  # productive seconds a rollback would throw away

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        if category == "productive":
            self.since_checkpoint += seconds

    def checkpointed(self) -> None:
        self.since_checkpoint = 0.0

    def rolled_back(self, badput: str = "lost") -> None:
        self.seconds["productive"] -= self.since_checkpoint
        self.seconds[badput] += self.since_checkpoint
        self.since_checkpoint = 0.0

    def wall(self) -> float:
        return self.earlier_wall + time.time() - self.started

    def fraction(self) -> float:
        return self.seconds["productive"] / max(self.wall(), 1e-9)

    def state_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "wall": self.wall(), "saved_at": time.time()}

    def resume(self, state: dict) -> None:
        """Continue the totals of the attempt that wrote the checkpoint. Everything from that
        save until this process started (steps redone, the crash, the restart) is lost."""
        lost = max(0.0, self.started - state["saved_at"])
        self.earlier_wall = state["wall"] + lost
        for name, value in state["seconds"].items():
            self.seconds[name] += value
        self.seconds["lost"] += lost

    def summary(self) -> str:
        wall = self.wall()
        parts = ", ".join(f"{n.replace('_', ' ')} {self.seconds[n]:.1f} s" for n in BADPUT)
        other = wall - sum(self.seconds.values())
        return (
            f"goodput {self.fraction():.1%} of {wall:.1f} s wall "
            f"(productive {self.seconds['productive']:.1f} s; badput: {parts}; other {other:.1f} s)"
        )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return ""


class MetricsLogger:
    """Accumulates step stats; every `log_every` steps writes one Progress record and line."""

    def __init__(self, run_dir, *, is_main, model_flops_per_token, peak, world_size, log):
        self.path = Path(run_dir) / progress_log.LOG_NAME
        self.is_main = is_main
        self.flops_per_token = model_flops_per_token
        self.peak, self.basis = peak  # (FLOP/s of one device, "table:..." or "measured")
        self.world_size = world_size
        self.log = log
        self.sinks = []  # callables taking a Progress (the launcher stream)
        self.identity = {}  # job_id, attempt, total_steps
        self.warned_mfu = False
        self._reset()
        if is_main and (dropped := progress_log.drop_unfinished_last_line(self.path)):
            log(f"{self.path}: dropped an unfinished last line ({dropped} bytes) left by a kill")

    def _reset(self) -> None:
        self.n, self.tokens, self.positions, self.padding = 0, 0, 0, 0
        self.losses: list[float] = []
        self.step_time = self.data_time = 0.0

    def step(self, *, tokens: int, positions: int, padding: int, loss, step_time, data_time):
        """One optimizer step: `tokens` trained on (all ranks), `positions` in the batch
        (including `padding`), its loss (None if skipped) and timings in seconds."""
        self.n += 1
        self.tokens += tokens
        self.positions += positions
        self.padding += padding
        if loss is not None:
            self.losses.append(loss)
        self.step_time += step_time
        self.data_time += data_time

    def emit(self, *, step, phase="train", **fields):
        """Write the record for the steps since the last emit (and any extra `fields`)."""
        from protos import progress_pb2

        p = progress_pb2.Progress(step=step, phase=phase, **self.identity, **fields)
        if self.n:
            p.loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
            p.step_time_seconds = self.step_time / self.n
            p.data_time_seconds = self.data_time / self.n
            p.tokens_per_second = self.tokens / max(self.step_time, 1e-9)
            per_device = p.tokens_per_second / self.world_size
            p.tflops = flops.achieved_flops_per_second(per_device, self.flops_per_token) / 1e12
            p.mfu = flops.mfu(per_device, self.flops_per_token, self.peak)
            if p.mfu > 1 and not self.warned_mfu:
                self.warned_mfu = True
                self.log(
                    f"WARNING: MFU {p.mfu:.0%} exceeds the {self.basis} peak "
                    f"({self.peak / 1e12:.3g} TFLOP/s): the device was busier during the "
                    "start-up calibration than now, so MFU reads high on this run"
                )
            p.mfu_basis = self.basis
            p.padding_fraction = self.padding / max(self.positions, 1)
        self.write(p)
        self._reset()
        return p

    def write(self, p) -> None:
        if self.is_main:
            progress_log.append_progress(self.path, p)
            for sink in self.sinks:
                sink(p)

    def human_line(self, p) -> str:
        return (
            f"step {p.step:>6}/{p.total_steps} | loss {p.loss:.4f} | grad norm {p.grad_norm:.3f}"
            f" | lr {p.lr:.2e} | {p.tokens_per_second:,.0f} tok/s"
            f" | step {p.step_time_seconds * 1e3:,.0f} ms"
            f" (data {p.data_time_seconds * 1e3:,.1f} ms)"
            f" | MFU {p.mfu:.1%} ({p.mfu_basis}), {p.tflops:.3g} TFLOP/s"
            f" | peak mem {human_bytes(p.peak_memory_bytes)} | padding {p.padding_fraction:.1%}"
            f" | goodput {p.goodput:.1%}"
            + (f" | B_simple {p.gradient_noise_scale:,.0f} tok" if p.gradient_noise_scale else "")
            + (f" | comm {p.comm_fraction:.0%}" if p.comm_fraction else "")
            + (
                f" | MoE imbalance {p.moe_max_imbalance:.2f}, entropy "
                f"{p.moe_min_router_entropy:.2f}, dropped {p.moe_dropped_fraction:.1%}"
                if p.moe_layers
                else ""
            )
            + (f" | skipped {p.skipped_steps}" if p.skipped_steps else "")
            + (f" | rollbacks {p.rollbacks}" if p.rollbacks else "")
        )
