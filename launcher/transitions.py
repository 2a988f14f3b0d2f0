"""A job's state changes, each computed on a copy: the controller stores the copy, then swaps it
into memory. No function here changes its input, so an exception half-way (a retry backoff
that overflows a timestamp, an unknown enum value, ...) leaves no job half-changed.
"""

import json

from launcher import scheduler
from launcher.executors.base import attempt_dir
from protos import job_pb2, progress_pb2

FINAL = (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED)


def stamp(ts, t: float):
    """Sets a Timestamp to epoch seconds `t` (raises on NaN or out of range)."""
    ts.FromNanoseconds(int(t * 1e9))


def seconds(ts) -> float:
    return ts.ToNanoseconds() / 1e9


def state_name(job: job_pb2.Job) -> str:
    return job_pb2.JobState.Name(job.state)


def _copy(job: job_pb2.Job) -> job_pb2.Job:
    out = job_pb2.Job()
    out.CopyFrom(job)
    return out


def demand(job: job_pb2.Job) -> scheduler.Demand:
    """A queued job as the scheduler sees it."""
    r = job.spec.resources
    not_before = seconds(job.not_before) if job.HasField("not_before") else 0.0
    return scheduler.Demand(
        job.id, int(job.id[1:]), job.spec.priority, job.pool, job.spec.team,
        r.nodes or 1, r.gpus_per_node, not_before,
    )  # fmt: skip


def parse_handle(job: job_pb2.Job) -> dict:
    """The stored handle of a live attempt, checked: a JSON object with attempt_dir."""
    handle = json.loads(job.handle)
    if not isinstance(handle, dict) or not isinstance(handle.get("attempt_dir"), str):
        raise ValueError(f"{job.id}: stored handle {job.handle[:200]!r} has no attempt_dir")
    return handle


def started(job: job_pb2.Job, allocation, now: float) -> job_pb2.Job:
    """STARTING with the next attempt's pre-start handle (enough to find it after a crash)."""
    out = _copy(job)
    out.attempts += 1
    handle = {"attempt_dir": attempt_dir(job.run_dir, out.attempts), "launched_at": now}
    out.state, out.stop = job_pb2.STARTING, job_pb2.STOP_REASON_UNSPECIFIED
    out.handle = json.dumps(handle)
    del out.allocation[:]
    for node, gpus in allocation:
        out.allocation.add(node=node, gpus=gpus)
    out.ClearField("not_before")
    if not out.HasField("started"):
        stamp(out.started, now)
    return out


def launched(job: job_pb2.Job, handle: dict, running: bool) -> job_pb2.Job:
    """The executor's handle stored; RUNNING once the executor says so."""
    out = _copy(job)
    out.handle = json.dumps(handle)
    if running:
        out.state = job_pb2.RUNNING
    return out


def stopping(job: job_pb2.Job, stop: job_pb2.StopReason, reason: str = "") -> job_pb2.Job:
    """Why the running attempt is being stopped (stored before the signal)."""
    out = _copy(job)
    out.stop = stop
    if reason:
        out.exit_reason = reason
    return out


def with_progress(job: job_pb2.Job, progress: progress_pb2.Progress, at: float) -> job_pb2.Job:
    out = _copy(job)
    out.progress.CopyFrom(progress)
    stamp(out.last_progress, at)
    return out


def ended(
    job: job_pb2.Job,
    outcome: scheduler.Outcome,
    never_started: bool,
    progress: progress_pb2.Progress | None,
    progress_at: float,
    now: float,
) -> job_pb2.Job:
    """After an attempt: final, or queued again (with a retry backoff after a failure)."""
    out = _copy(job)
    if progress is not None:
        out.progress.CopyFrom(progress)
        stamp(out.last_progress, progress_at)
    out.state, out.exit_reason = outcome.state, outcome.reason
    out.stop, out.handle = job_pb2.STOP_REASON_UNSPECIFIED, ""
    out.failures += int(outcome.failed)
    out.preemptions += int(outcome.preempted)
    out.attempts -= int(never_started)
    del out.allocation[:]
    if outcome.state in FINAL:
        stamp(out.finished, now)
    else:
        stamp(out.queued, now)
        if outcome.not_before:
            stamp(out.not_before, outcome.not_before)
    return out


def finished(job: job_pb2.Job, state: job_pb2.JobState, reason: str, now: float) -> job_pb2.Job:
    """Ended by the launcher itself: cancelled before it started, or FAILED for a reason."""
    out = _copy(job)
    out.state, out.exit_reason = state, reason
    out.stop, out.handle = job_pb2.STOP_REASON_UNSPECIFIED, ""
    del out.allocation[:]
    stamp(out.finished, now)
    return out
