"""What the leader of replicated launchers (launcher/leader.py) reads from the database that
other replicas took: submissions (QUEUED rows its loop does not know) and cancels (rows of
`cancel_requests`, launcher/pg_store.py). The controller's loop calls `take()` on every pass;
the store is read at most every SUBMISSION_SCAN seconds."""

import collections
import logging
from collections.abc import Callable

from launcher.job_steps import JobSteps, StoreError
from launcher.store_base import seq_of
from launcher.unfinished import UnfinishedJobs
from protos import job_pb2

log = logging.getLogger("kitchen.launcher")
# The QUEUED jobs other replicas took are read every SUBMISSION_SCAN s, above the newest seen
# LATE_COMMIT s ago (an insert commits within milliseconds of taking its id), and all of them
# every FULL_SCAN s. Cancel requests are read every SUBMISSION_SCAN s.
SUBMISSION_SCAN_SECONDS = 1.0
LATE_COMMIT_SECONDS = 10.0
FULL_SCAN_SECONDS = 60.0


class ReplicaInbox:
    def __init__(
        self,
        store,
        jobs: UnfinishedJobs,
        steps: JobSteps,
        enqueue: Callable[[job_pb2.Job], None],
        cancel: Callable[[str, float], object],
    ):
        """`enqueue(job)` queues a stored job; `cancel(job_id, now)` cancels one, as a cancel
        sent to the leader does."""
        self.store = store  # a PostgresStore
        self.jobs = jobs
        self.steps = steps
        self.enqueue = enqueue
        self.cancel = cancel
        self._scans: collections.deque[tuple[float, int]] = collections.deque()  # (when, top)
        self._next_scan = 0.0
        self._next_full_scan = 0.0

    def take(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + SUBMISSION_SCAN_SECONDS
        self._take_submissions(now)
        self._take_cancels(now)

    def _known(self, job_id: str) -> bool:
        return job_id in self.jobs.queued or job_id in self.jobs.live

    def _take_submissions(self, now: float) -> None:
        """Queues the jobs other replicas stored (QUEUED rows this loop does not know)."""
        cutoff = now - LATE_COMMIT_SECONDS
        while len(self._scans) > 1 and self._scans[1][0] <= cutoff:
            self._scans.popleft()
        oldest = self._scans[0] if self._scans else None
        floor = oldest[1] if oldest is not None and oldest[0] <= cutoff else 0
        if now >= self._next_full_scan:
            floor, self._next_full_scan = 0, now + FULL_SCAN_SECONDS
        jobs = self.store.queued_after(floor)
        for job in jobs:
            if not self._known(job.id) and job.id not in self.steps.doomed:
                self.steps.run(job.id, "queueing it", lambda j=job: self.enqueue(j), job)
        top = max([floor, *(seq_of(j.id) or 0 for j in jobs)])
        self._scans.append((now, max(top, self._scans[-1][1] if self._scans else 0)))

    def _take_cancels(self, now: float) -> None:
        """Acts on the cancels other replicas stored, then deletes each request (fenced: a
        request this leader could not finish stays for the next pass or the next leader)."""
        for job_id in self.store.cancel_requests():
            job = self.store.get(job_id)
            if job is not None and job.state == job_pb2.QUEUED and not self._known(job_id):
                self.enqueue(job)  # stored by a replica, not scanned yet: cancelled from the queue
            try:
                self.cancel(job_id, now)
            except StoreError as e:
                self.steps.hold(job_id, e.error)
                continue
            if self.store.cancel_request_done(job_id):
                log.info("%s: cancelled as another replica was asked to", job_id)
