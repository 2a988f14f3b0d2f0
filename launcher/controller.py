"""The launcher's control loop: the only writer of job state after submission.

One thread takes submissions and cancels from an inbox (`Submitted`, `CancelRequest`), polls
the executors, stops hung jobs, runs a scheduling pass when something changed, and records
progress. Memory holds one record per unfinished job (launcher/unfinished.py: `Queued` or
`LiveAttempt`); talking to executors is launcher/attempts.py.

Every change is all-or-nothing (launcher/job_steps.py): the new Job is computed on a copy
(launcher/transitions.py), written to the store, and only then swapped into memory. A state
change is stored before it is acted on (STARTING before the process starts, a stop reason
before the signal), so a launcher killed at any point resumes the same plan: `recover()`
re-reads unfinished jobs, re-attaches to running attempts and finishes stops. When handling
one job fails:
- the store write failed: memory stays as it was; the job is held back and retried later
  with a doubling delay, the error logged once and raised to a cancel's caller as it is; the
  loop carries on with the other jobs and recovers when the cause goes;
- anything else (a spec the code chokes on, a broken stored handle): that job is stored
  FAILED with the reason and leaves memory (its process, if any, is killed); no other job
  notices.
A pass that fails as a whole is retried with the same doubling delay: the loop never spins.
"""

import concurrent.futures
import dataclasses
import logging
import queue
import secrets
import threading
import time

from launcher import scheduler, transitions
from launcher.attempts import Attempts
from launcher.executors.base import Observed, Status
from launcher.faults import ErrorLog, Holds
from launcher.job_steps import JobSteps, StoreError
from launcher.replica_inbox import ReplicaInbox
from launcher.transitions import FINAL
from launcher.unfinished import LiveAttempt, Queued, UnfinishedJobs
from protos import job_pb2, launcher_pb2, progress_pb2

log = logging.getLogger("kitchen.launcher")
PROGRESS_FLUSH_SECONDS = 2.0
# A pass over a long queue costs ~1 us per job: after a pass that took d seconds, the next
# waits PASS_SPACING * d, so passes use at most ~10% of the loop even at 100 submits/s.
PASS_SPACING = 9.0


@dataclasses.dataclass(frozen=True)
class Submitted:
    job: job_pb2.Job  # as stored, QUEUED


@dataclasses.dataclass(frozen=True)
class CancelRequest:
    job_id: str
    done: concurrent.futures.Future  # gets the Job once the cancel is stored, or the error


class Controller:
    def __init__(
        self,
        cfg: launcher_pb2.LauncherConfig,
        store,
        executors: dict,
        metrics,
        events,
        clock=time.time,
        auth=False,
        env=None,
        tracker=None,
        replicas=False,
    ):
        self.cfg = cfg  # resolved
        self.store = store
        self.metrics = metrics
        self.tracker = tracker  # launcher/tracking/tracker.py; None: tracking off
        self.events = events
        self.clock = clock
        self.auth = auth
        self.pools = {p.name: scheduler.Pool(p.name, p.nodes, p.gpus_per_node) for p in cfg.pools}
        self.quotas = {q.team: scheduler.Quota(q.max_nodes, q.max_gpus) for q in cfg.quotas}
        self.jobs = UnfinishedJobs()
        self._inbox: queue.SimpleQueue[Submitted | CancelRequest] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._holds = Holds()
        self._errors = ErrorLog(log)
        self.attempts = Attempts(cfg, executors, dict(env or {}), self._errors, self._holds)
        self.steps = JobSteps(
            store, self.jobs, self.attempts, self._holds, self._errors, metrics, events,
            self.pools, clock,
        )  # fmt: skip
        self._wake_at: float | None = None
        self._next_pass_at = 0.0
        self._last_flush = 0.0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # False until start(): a replica that is not the leader runs no loop; it stores the
        # submissions and cancels it takes, and the leader's loop reads them (replica_inbox.py).
        self.leading = False
        self.replica_inbox = (
            ReplicaInbox(store, self.jobs, self.steps, self._enqueue, self._cancel)
            if replicas
            else None
        )

    # ---------------------------------------------------------------- API threads

    def submit(self, job: job_pb2.Job, request_id: str = "") -> tuple[job_pb2.Job, bool]:
        job.state = job_pb2.QUEUED
        transitions.stamp(job.created, self.clock())
        job.queued.CopyFrom(job.created)
        job, created = self.store.insert(job, request_id)  # the store gives id and run dir
        if created and self.leading:
            self._inbox.put(Submitted(job))
            self._wake.set()
        return job, created

    def cancel(self, job_id: str, timeout: float = 30.0) -> job_pb2.Job:
        """Returns once the cancel is stored (a running job is then being stopped)."""
        done: concurrent.futures.Future[job_pb2.Job] = concurrent.futures.Future()
        self._inbox.put(CancelRequest(job_id, done))
        self._wake.set()
        return done.result(timeout)

    def report_progress(self, job_id: str, attempt: int, progress) -> bool:
        """Records a trainer's report; False means the attempt is not current: stop it."""
        current = self.jobs.add_progress(job_id, attempt, progress, self.clock())
        if current is None:
            return False
        self.steps.effect("metrics", lambda: self.metrics.progress(*current))
        if self.tracker is not None:  # the report as sent: merged, eval would repeat train loss
            self.steps.effect("tracking", lambda: self.tracker.progress(current[0], progress))
        self.events.publish(job_id)
        return True

    def overlay(self, job: job_pb2.Job) -> job_pb2.Job:
        return self.jobs.overlay(job)

    def fleet(self) -> dict:
        return {**self.jobs.fleet(), "counts": self.store.counts()}

    # ---------------------------------------------------------------- the loop

    def start(self):
        self.recover()
        self.leading = True
        self._thread = threading.Thread(target=self._run, name="kitchen-controller", daemon=True)
        self._thread.start()

    def stop(self):
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._flush_progress()

    def _run(self):
        while not self._stopping.is_set():
            now = self.clock()
            timeout = self.cfg.poll_interval_seconds
            hold = self._holds.get("loop")
            if hold is not None and self._holds.held("loop", now):
                timeout = hold.retry_at - now
            else:
                try:
                    self.run_once()
                    self._holds.clear("loop")
                    self._errors.recovered("control loop")
                    if self.jobs.need_pass:
                        timeout = min(timeout, max(self._next_pass_at - self.clock(), 0.0))
                except Exception as e:
                    self._errors.failed("control loop", e)
                    timeout = self._holds.hold("loop", e, now).delay
            self._wake.wait(timeout)
            self._wake.clear()

    def run_once(self):
        now = self.clock()
        self._drain_inbox(now)
        if self.replica_inbox is not None:
            self.replica_inbox.take(now)
        self.steps.retry_doomed(now)
        self._poll(now)
        for job_id, live in list(self.jobs.live.items()):
            if not self._holds.held(job_id, now):
                self.steps.run(job_id, "watching it", lambda v=live: self._check(v, now))
        due = self.jobs.need_pass or (self._wake_at is not None and now >= self._wake_at)
        if due and now >= self._next_pass_at:
            self._schedule(now)
        if now - self._last_flush >= PROGRESS_FLUSH_SECONDS:
            self._flush_progress()
            self._last_flush = now

    def recover(self):
        """Takes up the unfinished jobs of the store (after a restart or a crash)."""
        now = self.clock()
        for job in self.store.unfinished():
            self.steps.run(job.id, "taking it up again", lambda j=job: self._recover(j, now), job)
        self.jobs.update_fleet(self.pools)

    def _recover(self, job, now):
        if job.pool not in self.pools:
            self.steps.fail(job.id, f"pool {job.pool!r} is not configured", job)
        elif job.state in (job_pb2.QUEUED, job_pb2.PREEMPTED):
            self._enqueue(job)
        else:
            live = LiveAttempt(job, transitions.parse_handle(job), started_at=now)
            self.jobs.put(live)
            if job.stop:
                self._signal_stop(live, now)
            state = transitions.state_name(job)
            log.info("re-attached %s (%s, attempt %d)", job.id, state, job.attempts)

    # ---------------------------------------------------------------- inbox

    def _drain_inbox(self, now):
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, Submitted):
                job = message.job
                self.steps.run(job.id, "queueing it", lambda j=job: self._enqueue(j), job)
                continue
            try:
                message.done.set_result(self._cancel(message.job_id, now))
            except StoreError as e:
                message.done.set_exception(e.error)  # the caller sees the store's error
            except Exception as e:
                self.steps.fail(message.job_id, f"launcher error while cancelling it: {e}")
                try:
                    message.done.set_result(self.store.get(message.job_id))
                except Exception as e2:
                    message.done.set_exception(e2)

    def _enqueue(self, job):
        self.jobs.put(Queued(job, transitions.demand(job)))
        self.jobs.need_pass = True
        self.events.publish(job.id)

    def _cancel(self, job_id, now) -> job_pb2.Job | None:
        if job_id in self.steps.doomed:
            job, reason = self.steps.doomed[job_id]
            self.steps.fail(job_id, reason, job)
            return self.store.get(job_id)
        queued = self.jobs.queued.get(job_id)
        if queued is not None:
            reason = "cancelled before it started"
            cancelled = self.steps.save(
                transitions.finished(queued.job, job_pb2.CANCELLED, reason, now)
            )
            self.jobs.drop(job_id)
            self.steps.effect("metrics", lambda: self.metrics.attempt_ended(cancelled, False))
            self._track_end(cancelled)
            self.steps.changed(job_id, final=True)
            return cancelled
        live = self.jobs.live.get(job_id)
        if live is None:
            return self.store.get(job_id)  # already final, or unknown (None)
        if live.job.stop != job_pb2.STOP_CANCEL:
            self._stop(live, job_pb2.STOP_CANCEL, "", now)
        return live.job

    # ---------------------------------------------------------------- live attempts

    def _poll(self, now):
        live = {
            job_id: attempt
            for job_id, attempt in self.jobs.live.items()
            if job_id not in self.steps.doomed and not self._holds.held(job_id, now)
        }
        for job_id, seen in self.attempts.poll(live, now):
            self.steps.run(
                job_id,
                "following its attempt",
                lambda v=live[job_id], s=seen: self._observed(v, s, now),
            )

    def _observed(self, live: LiveAttempt, seen: Observed, now):
        if seen.tasks is not None:  # a PRECOOK job's tasks, counted by the executor
            self._tasks_progress(live, *seen.tasks)
        if seen.status == Status.RUNNING and live.job.state == job_pb2.STARTING:
            live.job = self.steps.save(transitions.launched(live.job, live.handle, running=True))
            self.events.publish(live.job.id)
        elif seen.status not in (Status.PENDING, Status.RUNNING):
            self._attempt_ended(live, seen, now)

    def _tasks_progress(self, live: LiveAttempt, done: int, total: int):
        last = live.progress
        if last is not None and last.precook_tasks_done == done and last.precook_tasks_total:
            return
        report = progress_pb2.Progress(
            phase="precook", precook_tasks_done=done, precook_tasks_total=total,
            message=f"precook tasks done: {done}/{total}",
        )  # fmt: skip
        self.report_progress(live.job.id, live.job.attempts, report)

    def _check(self, live: LiveAttempt, now):
        if live.kill_at is not None and now >= live.kill_at:
            grace = self.cfg.kill_grace_seconds
            log.warning("%s did not stop within %.0f s: SIGKILL", live.job.id, grace)
            live.kill_at = now + grace  # and again then, if need be
            self.attempts.kill(live)
        elif live.job.state == job_pb2.RUNNING and not live.job.stop:
            reason = self.attempts.hang_reason(live, now)
            if reason:
                log.warning("%s: %s: restarting it", live.job.id, reason)
                self._stop(live, job_pb2.STOP_HANG, reason, now)

    def _stop(self, live: LiveAttempt, stop: job_pb2.StopReason, reason: str, now):
        live.job = self.steps.save(transitions.stopping(live.job, stop, reason))
        self._signal_stop(live, now)
        self.events.publish(live.job.id)

    def _signal_stop(self, live: LiveAttempt, now):
        """SIGTERM now (the stop reason is already stored), SIGKILL after the grace period."""
        live.kill_at = now + self.cfg.kill_grace_seconds
        self.attempts.terminate(live)

    def _attempt_ended(self, live: LiveAttempt, seen: Observed, now):
        job = live.job
        detail = self.attempts.end_detail(live, seen)
        never = seen.status == Status.NEVER_STARTED
        out = scheduler.after_exit(job, seen.exit_code, detail, now, never_started=never)
        ended = transitions.ended(job, out, never, *self.jobs.progress_of(live), now)
        final = ended.state in FINAL
        queued = None if final else Queued(ended, transitions.demand(ended))  # before saving
        self.steps.save(ended)
        if queued is None:
            self.jobs.drop(job.id)
        else:
            self.jobs.put(queued)
        self.jobs.need_pass = True
        log.info("%s: attempt %d ended: %s", job.id, job.attempts, out.reason)
        self.steps.effect("metrics", lambda: self.metrics.attempt_ended(ended, out.preempted))
        self._track_end(ended)
        self.steps.changed(job.id, final)

    def _track_end(self, job: job_pb2.Job):
        if self.tracker is not None and job.attempts and job.state in FINAL:
            self.steps.effect("tracking", lambda: self.tracker.job_ended(job))

    # ---------------------------------------------------------------- scheduling

    def _schedule(self, now):
        """One pass: plan, then act. Its duration (the decision, without starting processes
        or signalling them) is kitchen_scheduler_pass_duration_seconds."""
        started = time.perf_counter()
        demands = self.jobs.demands(skip=self.steps.doomed)
        plan, failed = scheduler.plan_around_failures(
            self.pools, self.quotas, demands, self.jobs.holdings(), now
        )
        for job_id, e in failed.items():
            log.error("%s: the scheduler cannot place it", job_id, exc_info=e)
            self.steps.fail(job_id, f"launcher error while scheduling it: {type(e).__name__}: {e}")
        for job_id, hold in self._holds.items():
            if job_id in plan.waiting:
                plan.waiting[job_id] = f"the launcher could not store its start ({hold.error})"
        changed = self.jobs.set_waiting(plan.waiting)
        self._wake_at, self.jobs.need_pass = plan.wake_at, False
        took = time.perf_counter() - started
        self.metrics.scheduler_pass.observe(took)
        self._next_pass_at = now + PASS_SPACING * took
        for job_id in plan.preempt:
            log.info("preempting %s for a higher-priority job", job_id)
            live = self.jobs.live[job_id]
            self.steps.run(
                job_id, "preempting it", lambda v=live: self._stop(v, job_pb2.STOP_PREEMPT, "", now)
            )
        for job_id, allocation in plan.start.items():
            queued = self.jobs.queued[job_id]
            self.steps.run(
                job_id, "starting it", lambda q=queued, a=allocation: self._start(q, a, now)
            )
        self.jobs.update_fleet(self.pools)
        self.events.publish_many(changed)

    def _start(self, queued: Queued, allocation, now):
        starting = transitions.started(queued.job, allocation, now)
        token = secrets.token_urlsafe(24) if self.auth else ""
        self.steps.save(starting, attempt_token=token)  # durable before anything starts
        live = LiveAttempt(starting, transitions.parse_handle(starting), started_at=now)
        self.jobs.put(live)
        waited = now - transitions.seconds(starting.queued)
        self.steps.effect("metrics", lambda: self.metrics.attempt_started(starting, waited))
        if self.tracker is not None:
            self.steps.effect("tracking", lambda: self.tracker.job_started(starting))
        try:
            live.handle, status = self.attempts.start(starting, live.handle, token)
        except Exception as e:
            log.exception("%s: could not start attempt %d", starting.id, starting.attempts)
            self._attempt_ended(live, Observed(Status.LOST, None, f"could not start: {e}"), now)
            return
        live.job = self.steps.save(
            transitions.launched(starting, live.handle, status == Status.RUNNING)
        )
        state = transitions.state_name(live.job).lower()
        log.info("%s: attempt %d %s", starting.id, starting.attempts, state)
        self.events.publish(starting.id)

    def _flush_progress(self):
        for live, progress, at in self.jobs.take_unsaved_progress():

            def record(live=live, progress=progress, at=at):
                live.job = self.steps.save(transitions.with_progress(live.job, progress, at))

            held = self._holds.held(live.job.id, self.clock())
            if held or not self.steps.run(live.job.id, "recording its progress", record):
                self.jobs.mark_unsaved(live)  # the next flush tries again
