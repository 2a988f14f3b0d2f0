"""The hang watchdog: a rank that stops progressing is found, every rank's Python stacks are
dumped, and the job fails with a message naming the stuck rank.

Each rank runs a thread that publishes this rank's heartbeat (step, collectives entered, in a
collective or not) to the process group's key-value store (torchrun's TCPStore, a connection
separate from the collectives, so it answers while they hang) and watches for either of two
things: no progress on this rank (no step ended, no collective completed) for
`hang_timeout_seconds`, or another rank raising the alarm in the store. Then it:

1. raises the alarm (so every rank dumps now, before the launcher tears the group down),
2. writes this rank's stacks with faulthandler to <run dir>/hang/rank-<R>.txt,
3. waits (a few seconds at most) for the other ranks' dumps,
4. compares heartbeats: the stuck rank is the one behind (fewest collectives entered, while
   the others wait inside the next one); when all are level, every rank waits in the same
   collective (a collective that never completes, e.g. a lost peer on the network),
5. writes <run dir>/hang/report.json (protos/hang_report.py), prints the message and exits
   the process with ExitCode.FAILED: the main thread is stuck and cannot be unwound.
"""

import dataclasses
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from protos import hang_report
from protos.exit_codes import ExitCode
from trainer.health.collectives import CollectiveTracker

ALARM_KEY = "kitchen/health/hang"
DUMPED_KEY = "kitchen/health/dumped"
DUMP_WAIT_SECONDS = 10.0  # for the other ranks' dumps, once the alarm is up


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    rank: int
    host: str
    step: int  # the step this rank is on (the last one ended + 1)
    entered: int  # synchronous collectives entered
    inside: bool  # blocked in one now
    idle_seconds: float  # since this rank last progressed


def stuck_ranks(beats: list[Heartbeat]) -> list[Heartbeat]:
    """The ranks behind the others: fewest collectives entered (then the lowest step). Empty
    when every rank is level (all wait in the same collective)."""
    lowest = min((b.entered, b.step) for b in beats)
    behind = [b for b in beats if (b.entered, b.step) == lowest]
    return [] if len(behind) == len(beats) else behind


def describe(beats: list[Heartbeat], dumps: str, timeout: float) -> tuple[str, list[Heartbeat]]:
    stuck = stuck_ranks(beats)
    step = min(b.step for b in beats)
    if stuck:
        names = ", ".join(f"rank {b.rank} on {b.host}" for b in stuck)
        waiting = len(beats) - len(stuck)
        where = "in a collective" if all(b.inside for b in stuck) else "outside any collective"
        what = (
            f"{names} stopped {where} at step {step}; the other {waiting} rank(s) wait for it "
            f"in collective #{max(b.entered for b in beats)}"
        )
    else:
        what = (
            f"every rank waits in collective #{beats[0].entered} at step {step}; no rank is "
            "behind (a collective that never completes)"
        )
    return (
        f"hang: no progress for {timeout:.0f} s (trainer.health.hang_timeout_seconds): {what}. "
        f"Python stacks of every rank: {dumps}/rank-*.txt"
    ), stuck


class Watchdog:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        timeout: float,
        tracker: CollectiveTracker,
        store=None,
        log: Callable[[str], None] = print,
        exit: Callable[[int], None] = os._exit,
    ):
        """`store`: the process group's key-value store (None on a single process)."""
        self.run_dir, self.rank, self.world_size = str(run_dir), rank, world_size
        self.timeout, self.tracker, self.store = timeout, tracker, store
        self.log, self.exit = log, exit
        self.host = socket.gethostname()
        self.step = 1
        self.last_beat = time.monotonic()
        self.interval = min(1.0, timeout / 10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self.fired: str | None = None

    def start(self) -> None:
        if self.timeout > 0:
            self.last_beat = time.monotonic()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def beat(self, step_ended: int) -> None:
        """A step ended (called by the training loop)."""
        self.step = step_ended + 1
        self.last_beat = time.monotonic()

    def heartbeat(self) -> Heartbeat:
        progressed = max(self.last_beat, self.tracker.last_exit)
        return Heartbeat(
            self.rank,
            self.host,
            self.step,
            self.tracker.entered,
            self.tracker.inside,
            round(time.monotonic() - progressed, 3),
        )

    def _key(self, rank: int) -> str:
        return f"kitchen/health/beat/{rank}"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            beat = self.heartbeat()
            alarm = False
            if self.store is not None:
                self.store.set(self._key(self.rank), json.dumps(dataclasses.asdict(beat)))
                alarm = self.store.check([ALARM_KEY])
            if alarm or beat.idle_seconds > self.timeout:
                self._fire()
                return

    def _fire(self) -> None:
        if self.store is not None:
            self.store.set(ALARM_KEY, str(self.rank))
        os.makedirs(hang_report.hang_dir(self.run_dir), exist_ok=True)
        mine = self.heartbeat()
        with open(hang_report.dump_path(self.run_dir, self.rank), "w") as f:
            f.write(f"{json.dumps(dataclasses.asdict(mine))}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        beats = [mine]
        if self.store is not None:
            self.store.add(DUMPED_KEY, 1)
            deadline = time.monotonic() + DUMP_WAIT_SECONDS
            while self.store.add(DUMPED_KEY, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.1)
            keys = [self._key(r) for r in range(self.world_size)]
            # A rank that never sent a heartbeat is further behind than anyone.
            beats = [
                Heartbeat(**json.loads(self.store.get(k)))
                if self.store.check([k])
                else Heartbeat(r, "?", 0, -1, False, 0.0)
                for r, k in enumerate(keys)
            ]
        dumps = hang_report.hang_dir(self.run_dir)
        message, stuck = describe(beats, dumps, self.timeout)
        report = hang_report.HangReport(
            step=min(b.step for b in beats),
            stuck_ranks=[b.rank for b in stuck],
            stuck_hosts=[b.host for b in stuck],
            idle_seconds=max(b.idle_seconds for b in beats),
            dumps=dumps,
            message=message,
            written_at=time.time(),
        )
        if self.rank == 0 or self.store is None:
            hang_report.write_report(self.run_dir, report)
        self.fired = message
        self.log(message)
        print(f"rank {self.rank}: {message}", file=sys.stderr, flush=True)
        self.exit(ExitCode.FAILED)
