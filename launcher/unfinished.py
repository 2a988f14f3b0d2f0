"""The controller's memory of unfinished jobs: one record per job, shared with API threads.

A job is `Queued` (the job as stored and its scheduler Demand) or has a `LiveAttempt` (the job
as stored, its parsed handle, when it started, when to SIGKILL, its latest progress). Only the
control loop's thread adds, moves or drops records, always under the lock, and it replaces a
record's job instead of changing it, so API threads may read any job they get from here. API
threads add progress reports to live attempts (under the lock) and read the overlay and the
fleet summary
(queue depth per pool, capacity and use).
"""

import collections
import dataclasses
import threading

from launcher import scheduler, transitions
from protos import job_pb2, progress_pb2


@dataclasses.dataclass
class Queued:
    job: job_pb2.Job  # as stored
    demand: scheduler.Demand


@dataclasses.dataclass
class LiveAttempt:
    """A job with a live attempt (STARTING or RUNNING)."""

    job: job_pb2.Job  # as stored; replaced, never changed in place
    handle: dict  # parsed once; the executor's, ahead of job.handle until the next write
    started_at: float  # when this attempt started (or was re-attached)
    kill_at: float | None = None  # SIGKILL then (a stop was signalled)
    # Written by API threads under the lock: merged reports, when the last one came.
    progress: progress_pb2.Progress | None = None
    progress_at: float = 0.0
    progress_unsaved: bool = False


class UnfinishedJobs:
    def __init__(self):
        self.lock = threading.Lock()
        self.queued: dict[str, Queued] = {}  # read freely by the loop thread, its only writer
        self.live: dict[str, LiveAttempt] = {}
        self._waiting: dict[str, str] = {}  # job_id -> why it waits (the last pass's words)
        self._fleet: dict = {"queued": {}, "pools": {}}
        self.need_pass = True  # the queue or the capacity changed: a scheduling pass is due
        # Kept as records come and go, so a pass over 100,000 queued jobs does not rebuild them.
        self._depth: collections.Counter[str] = collections.Counter()  # queued jobs per pool
        self._demands: list[scheduler.Demand] | None = None  # None: the queue changed

    # ---------------------------------------------------------------- loop thread

    def put(self, record: Queued | LiveAttempt):
        """Files the job's record (replacing the other kind, if any)."""
        job_id = record.job.id
        with self.lock:
            self._forget(job_id)
            if isinstance(record, Queued):
                self.queued[job_id] = record
                self._depth[record.demand.pool] += 1
                self._demands = None
            else:
                self.live[job_id] = record

    def drop(self, job_id: str):
        with self.lock:
            self._forget(job_id)

    def _forget(self, job_id: str):
        was = self.queued.pop(job_id, None)
        if was is not None:
            self._depth[was.demand.pool] -= 1
            self._demands = None
        self.live.pop(job_id, None)

    def progress_of(self, live: LiveAttempt) -> tuple[progress_pb2.Progress | None, float]:
        with self.lock:
            return live.progress, live.progress_at

    def take_unsaved_progress(self) -> list[tuple[LiveAttempt, progress_pb2.Progress, float]]:
        with self.lock:
            dirty = [live for live in self.live.values() if live.progress_unsaved]
            for live in dirty:
                live.progress_unsaved = False
            return [(lv, lv.progress, lv.progress_at) for lv in dirty if lv.progress is not None]

    def mark_unsaved(self, live: LiveAttempt):
        with self.lock:
            live.progress_unsaved = True

    def set_waiting(self, waiting: dict[str, str]) -> list[str]:
        """Records why jobs wait; returns the jobs whose reason changed."""
        with self.lock:
            if waiting == self._waiting:  # the usual pass: one comparison in C, not 100,000
                changed = []
            else:
                changed = [j for j, r in waiting.items() if self._waiting.get(j) != r]
            self._waiting = waiting
        return changed

    def demands(self, skip=()) -> list[scheduler.Demand]:
        """The queued jobs as the scheduler sees them (but those in `skip`)."""
        if self._demands is None:  # kept in queue order: sorting it again in a pass is ~linear
            self._demands = sorted(
                (q.demand for q in self.queued.values()), key=scheduler.QUEUE_ORDER
            )
        if not skip:
            return self._demands
        return [d for d in self._demands if d.job_id not in skip]

    def holdings(self) -> list[scheduler.Holding]:
        """The live attempts as the scheduler sees them."""
        return [
            scheduler.Holding(
                job_id, live.job.spec.priority, live.job.pool, live.job.spec.team,
                tuple((a.node, tuple(a.gpus)) for a in live.job.allocation),
                live.started_at, stopping=bool(live.job.stop),
            )
            for job_id, live in self.live.items()
        ]  # fmt: skip

    def update_fleet(self, pools: dict[str, scheduler.Pool]):
        depth = {pool: n for pool, n in self._depth.items() if n}
        fleet = fleet_summary(pools, depth, [live.job for live in self.live.values()])
        with self.lock:
            self._fleet = fleet

    # ---------------------------------------------------------------- API threads

    def add_progress(self, job_id: str, attempt: int, progress, now: float):
        """Merges a report into the live attempt's; (job, merged) or None if not current.

        proto3 MergeFrom: fields left at zero keep their last value, because eval and done
        reports carry only eval_loss, goodput and a message: the job keeps its last training
        loss, throughput and MFU."""
        with self.lock:
            live = self.live.get(job_id)
            if live is None or live.job.attempts != attempt:
                return None
            merged = progress_pb2.Progress()
            if live.progress is not None:
                merged.CopyFrom(live.progress)
            merged.MergeFrom(progress)
            live.progress, live.progress_at, live.progress_unsaved = merged, now, True
            return live.job, merged

    def overlay(self, job: job_pb2.Job) -> job_pb2.Job:
        """The stored job plus what only memory knows: newest progress, why it waits."""
        with self.lock:
            live = self.live.get(job.id)
            if (
                live is not None
                and live.progress is not None
                and job.state not in transitions.FINAL
            ):
                job.progress.CopyFrom(live.progress)
                transitions.stamp(job.last_progress, live.progress_at)
            job.waiting_reason = self._waiting.get(job.id, "")
        return job

    def fleet(self) -> dict:
        with self.lock:
            return dict(self._fleet)


def fleet_summary(
    pools: dict[str, scheduler.Pool], depth: dict[str, int], running: list[job_pb2.Job]
) -> dict:
    """{"queued": {pool: jobs} (`depth`), "pools": {pool: capacity and use in nodes and GPUs}}."""
    summary = {
        name: {
            "nodes_capacity": p.nodes, "gpus_capacity": p.nodes * p.gpus_per_node,
            "nodes_in_use": 0, "gpus_in_use": 0,
        }
        for name, p in pools.items()
    }  # fmt: skip
    for job in running:
        if job.pool in summary:
            summary[job.pool]["nodes_in_use"] += len(job.allocation)
            summary[job.pool]["gpus_in_use"] += sum(len(a.gpus) for a in job.allocation)
    return {"queued": depth, "pools": summary}
