"""A profile of a few training steps on request (trainer.profile, protos/trainer_config.proto).

The loop talks to one StepProfiler: `step(n)` around each whole step, `data_wait()` around
reading its batches. With profile.steps 0 both are empty contexts (nothing is imported or
recorded). Else torch.profiler records steps start_step .. start_step + steps - 1, after one
warm-up step (the profiler's own start-up cost stays out of the trace); then every rank saves
its trace, in Chrome trace format, to `<run dir>/profile/trace_rank<R>.json` (chrome://tracing,
ui.perfetto.dev), and rank 0 reads its own back into the table (trainer/profile_table.py),
with every rank's step, data-loader wait and communication beside it (up to MAX_RANKS traces
read), logs it, and writes it to profile/profile.md and profile/profile.json. The launcher
uploads the directory to the job's MLflow run (launcher/tracking/records.py).

A process that starts past the window (a resumed run) has nothing to profile and says so.
"""

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from protos import trainer_config_pb2
from protos.files import fsync_dir, write_atomic, write_json_atomic
from protos.paths import PROFILE_DIR
from trainer import distributed, profile_table

if TYPE_CHECKING:
    import torch.profiler

    from trainer.distributed import DistEnv

TABLE_MD, TABLE_JSON = "profile.md", "profile.json"
MAX_RANKS = 16  # rank 0 reads this many ranks' traces for the side-by-side summary


def trace_name(rank: int) -> str:
    return f"trace_rank{rank}.json"


class StepProfiler:
    def __init__(
        self,
        cfg: trainer_config_pb2.ProfileConfig,
        run_dir: Path,
        env: "DistEnv",
        log: Callable[[str], None],
    ):
        """`cfg`: resolved (defaults applied)."""
        self.cfg, self.env, self.log = cfg, env, log
        self.dir = Path(run_dir) / PROFILE_DIR
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.warmup = 1 if cfg.start_step > 1 else 0
        self._profiler: torch.profiler.profile | None = None
        self._checked = False
        self.table: profile_table.ProfileTable | None = None  # rank 0's, once saved

    def _wanted(self, step: int) -> bool:
        """Whether `step` is the warm-up step or a profiled one; says once if the window
        was passed before this process started."""
        if not self.cfg.steps:
            return False
        if not self._checked:
            self._checked = True
            if step > self.first - self.warmup and step <= self.last:
                self.log(
                    f"profile: steps {self.first}..{self.last} were asked for and this process "
                    f"starts at step {step} (resumed): no profile"
                )
                self.last = 0
        return self.first - self.warmup <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the whole of step `step` (1-based)."""
        if not self._wanted(step):
            yield
            return
        import torch.profiler

        if self._profiler is None:
            self._profiler = self._start()
        with torch.profiler.record_function(f"{profile_table.STEP} {step}"):
            yield
        self._profiler.step()  # the last profiled step's call saves the trace (_save)
        if step == self.last:
            self.close()

    def data_wait(self) -> contextlib.AbstractContextManager:
        """Around reading a step's batches."""
        if self._profiler is None:
            return contextlib.nullcontext()
        import torch.profiler

        return torch.profiler.record_function(profile_table.DATA_WAIT)

    def close(self) -> None:
        """Stop recording; a profile cut short (the run stopped inside it) is not saved."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def _start(self) -> "torch.profiler.profile":
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=0, warmup=self.warmup, active=self.cfg.steps, repeat=1
            ),
            on_trace_ready=self._save,
        )
        profiler.start()
        return profiler

    def _save(self, profiler: "torch.profiler.profile") -> None:
        """on_trace_ready: every rank at the end of the last profiled step. A profile that
        cannot be written or read is logged, never a reason to stop training."""
        path = self.dir / trace_name(self.env.rank)
        try:
            os.makedirs(self.dir, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            profiler.export_chrome_trace(str(tmp))  # torch writes it: fsync, then rename
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(str(self.dir))
        except OSError as err:
            self.log(f"profile: rank {self.env.rank} could not save its trace: {err}")
        distributed.barrier()  # every rank's trace is saved (all reach this step's end)
        if self.env.is_main:
            try:
                self._write_table(path)
            except (OSError, profile_table.TraceError) as err:
                self.log(f"profile: no table: {err}")

    def _write_table(self, path: Path) -> None:
        """Rank 0's table, and every rank's summary whose trace this file system holds."""
        traces = [self.dir / trace_name(r) for r in range(min(self.env.world_size, MAX_RANKS))]
        tables = [
            profile_table.analyse(profile_table.read_trace(str(p)), self.cfg.top_ops, str(p))
            for p in traces
            if p == path or p.exists()  # another node's run dir may hold it instead
        ]
        text = tables[0].render()
        if len(tables) > 1:
            text += "\n" + profile_table.render_ranks(tables)
        write_atomic(str(self.dir / TABLE_MD), text)
        write_json_atomic(str(self.dir / TABLE_JSON), {"ranks": [t.to_json() for t in tables]})
        self.table = tables[0]
        size = path.stat().st_size / 1e6
        self.log(f"profile: trace {path} ({size:.1f} MB; every rank's beside it)")
        for line in text.rstrip("\n").split("\n"):
            self.log(line)
