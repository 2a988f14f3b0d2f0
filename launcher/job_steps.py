"""Runs the control loop's steps for one job all-or-nothing, so one job cannot stop the loop.

A step computes the job's new state on a copy (launcher/transitions.py), stores it with
`save()`, and only then swaps it into memory (launcher/unfinished.py). `run()` decides what a
failing step means:
- the store write failed (StoreError): memory stays as it was; the job is held back (faults.Holds:
  its retry waits twice as long each time) and the error is logged once (faults.ErrorLog);
- anything else (a spec the code chokes on, a broken stored handle): `fail()` stores the job
  FAILED with the reason, drops it from memory and kills its process if it has one. When even
  that write fails, the job is "doomed": skipped by every step, retried until stored FAILED.
What follows a stored change (metrics, signals) goes through `effect()`: logged, never fatal.
"""

import dataclasses
import logging

from launcher import transitions
from launcher.attempts import Attempts
from launcher.faults import ErrorLog, Holds
from launcher.unfinished import Queued, UnfinishedJobs
from protos import job_pb2

log = logging.getLogger("kitchen.launcher")


class StoreError(Exception):
    """A store write failed; `error` is what the store raised (what a caller gets to see)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class JobSteps:
    def __init__(
        self,
        store,
        jobs: UnfinishedJobs,
        attempts: Attempts,
        holds: Holds,
        errors: ErrorLog,
        metrics,
        events,
        pools: dict,
        clock,
    ):
        self.store = store
        self.jobs = jobs
        self.attempts = attempts  # kills a failed job's process
        self.holds = holds
        self.errors = errors
        self.metrics = metrics
        self.events = events
        self.pools = pools  # name -> scheduler.Pool, for the fleet summary
        self.clock = clock
        self.doomed: dict[str, tuple[job_pb2.Job, str]] = {}  # to store FAILED: job, reason

    def save(self, job: job_pb2.Job, attempt_token: str | None = None) -> job_pb2.Job:
        """Stores `job` (the one way the controller writes); a failure raises StoreError."""
        try:
            self.store.update(job, attempt_token=attempt_token)
        except Exception as e:
            raise StoreError(e) from e
        self.holds.clear(job.id)
        self.errors.recovered("store write")
        return job

    def run(self, job_id: str, what: str, step, job: job_pb2.Job | None = None) -> bool:
        """Runs `step()` for the job; True if it went through. `job`: the job as stored, when
        memory does not hold it yet."""
        if job_id in self.doomed:
            return False
        try:
            step()
            return True
        except StoreError as e:
            self.hold(job_id, e.error)
        except Exception as e:
            log.error("%s: error while %s", job_id, what, exc_info=e)
            self.fail(job_id, f"launcher error while {what}: {type(e).__name__}: {e}", job)
        return False

    def held(self, job_id: str, now: float) -> bool:
        return self.holds.held(job_id, now)

    def hold(self, job_id: str, error: Exception):
        self.errors.failed("store write", error)
        hold = self.holds.hold(job_id, error, self.clock())
        queued = self.jobs.queued.get(job_id)
        if queued is not None:  # the scheduler sees it again once the hold ends
            not_before = max(queued.demand.not_before, hold.retry_at)
            demand = dataclasses.replace(queued.demand, not_before=not_before)
            self.jobs.put(Queued(queued.job, demand))
            self.jobs.need_pass = True

    def fail(self, job_id: str, reason: str, job: job_pb2.Job | None = None):
        """Stores the job FAILED with `reason` and drops it from memory; never raises."""
        live, queued = self.jobs.live.get(job_id), self.jobs.queued.get(job_id)
        current = live.job if live else queued.job if queued else job
        if current is None:
            return
        try:
            failed = self.save(transitions.finished(current, job_pb2.FAILED, reason, self.clock()))
        except StoreError as e:
            self.doomed[job_id] = (current, reason)
            self.hold(job_id, e.error)
            return
        except Exception as e:  # cannot even say FAILED: the next launcher takes it up
            log.error("%s: cannot record the failure %r", job_id, reason, exc_info=e)
            failed = None
        self.jobs.drop(job_id)
        self.doomed.pop(job_id, None)
        log.error("%s FAILED: %s", job_id, reason)
        if live is not None:  # its process may still run
            self.attempts.kill(live)
            if failed is not None:
                self.effect("metrics", lambda: self.metrics.attempt_ended(failed, False))
        self.changed(job_id, final=True)

    def retry_doomed(self, now: float):
        for job_id, (job, reason) in list(self.doomed.items()):
            if not self.holds.held(job_id, now):
                self.fail(job_id, reason, job)

    def effect(self, kind: str, call):
        """What follows a stored change (metrics, signals): a failure is logged, not fatal."""
        try:
            call()
        except Exception as e:
            self.errors.failed(kind, e)

    def changed(self, job_id: str, final: bool):
        """Tells watchers; a job that ended frees capacity: a scheduling pass is due."""
        if final:
            self.jobs.need_pass = True
            self.jobs.update_fleet(self.pools)
        self.events.publish(job_id)
        if final:
            self.events.forget(job_id)
