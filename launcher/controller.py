"""The launcher's control loop: the only writer of job state after submission.

One thread takes submissions and cancels from an inbox, polls the executors, stops hung jobs,
runs a scheduling pass when something changed, and records progress. Every state change is
written to the store before it is acted on (STARTING is stored before the process starts, a
stop reason before the signal), so a launcher killed at any point resumes the same plan:
`recover()` re-reads unfinished jobs, re-attaches to running attempts and finishes stops.
"""

import concurrent.futures
import json
import logging
import os
import queue
import secrets
import threading
import time

from google.protobuf import json_format

from launcher import scheduler
from launcher.executors.attempt_wrapper import write_json_atomically
from launcher.executors.base import Launch, Observed, Status, attempt_dir, last_line
from protos import job_pb2, progress_pb2

log = logging.getLogger("kitchen.launcher")
FINAL = (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED)
PROGRESS_FLUSH_SECONDS = 2.0
# A pass over a long queue costs ~1 us per job: after a pass that took d seconds, the next
# waits PASS_SPACING * d, so passes use at most ~10% of the loop even at 100 submits/s.
PASS_SPACING = 9.0


def _stamp(ts, t: float):
    ts.FromNanoseconds(int(t * 1e9))


class Controller:
    def __init__(
        self, cfg, store, executors, metrics, events, clock=time.time, auth=False, env=None
    ):
        self.cfg = cfg  # resolved LauncherConfig
        self.store = store
        self.executors = executors  # pool name -> Executor
        self.metrics = metrics
        self.events = events
        self.clock = clock
        self.auth = auth
        self.env = dict(env or {})
        self.pools = {p.name: scheduler.Pool(p.name, p.nodes, p.gpus_per_node) for p in cfg.pools}
        self.quotas = {q.team: scheduler.Quota(q.max_nodes, q.max_gpus) for q in cfg.quotas}
        self._inbox = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards what API threads read: below, down to _fleet
        self._attempts = {}  # job_id -> (attempt number, Job at start) of live attempts
        self._progress = {}  # job_id -> (Progress, time received)
        self._dirty = set()
        self._waiting = {}
        self._fleet = {"queued": {}, "pools": {}}
        self._pending = {}  # job_id -> Job; loop thread only from here down
        self._demands = {}
        self._running = {}
        self._started_at = {}  # job_id -> when the current attempt started (or was re-attached)
        self._kill_at = {}
        self._need_pass = True
        self._wake_at = None
        self._next_pass_at = 0.0
        self._last_flush = 0.0
        self._thread = None
        self._stopping = threading.Event()

    # ---------------------------------------------------------------- API threads

    def submit(self, job: job_pb2.Job, request_id: str = "") -> tuple[job_pb2.Job, bool]:
        job.state = job_pb2.QUEUED
        _stamp(job.created, self.clock())
        job.queued.CopyFrom(job.created)
        runs = os.path.join(self.cfg.state_dir, "runs")
        job, created = self.store.insert(
            job, request_id, on_id=lambda j: setattr(j, "run_dir", os.path.join(runs, j.id))
        )
        if created:
            self._inbox.put(("submitted", job))
            self._wake.set()
        return job, created

    def cancel(self, job_id: str, timeout: float = 30.0) -> job_pb2.Job:
        """Returns once the cancel is stored (a running job is then being stopped)."""
        done = concurrent.futures.Future()
        self._inbox.put(("cancel", job_id, done))
        self._wake.set()
        return done.result(timeout)

    def report_progress(self, job_id: str, attempt: int, progress) -> bool:
        """Records a trainer's report; False means the attempt is not current: stop it.

        Reports merge (proto3 MergeFrom: fields left at zero keep their last value), because
        eval and done reports carry only eval_loss, goodput and a message: the job keeps
        its last training loss, throughput and MFU."""
        with self._lock:
            live = self._attempts.get(job_id)
            if live is None or live[0] != attempt:
                return False
            merged = progress_pb2.Progress()
            if job_id in self._progress:
                merged.CopyFrom(self._progress[job_id][0])
            merged.MergeFrom(progress)
            self._progress[job_id] = (merged, self.clock())
            self._dirty.add(job_id)
        self.metrics.progress(live[1], merged)
        self.events.publish(job_id)
        return True

    def overlay(self, job: job_pb2.Job) -> job_pb2.Job:
        """The stored job plus what only memory knows: newest progress, why it waits."""
        with self._lock:
            latest = self._progress.get(job.id)
            if latest is not None and job.state not in FINAL:
                job.progress.CopyFrom(latest[0])
                _stamp(job.last_progress, latest[1])
            job.waiting_reason = self._waiting.get(job.id, "")
        return job

    def fleet(self) -> dict:
        with self._lock:
            fleet = dict(self._fleet)
        fleet["counts"] = self.store.counts()
        return fleet

    # ---------------------------------------------------------------- the loop

    def start(self):
        self.recover()
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
            try:
                self.run_once()
            except Exception:
                log.exception("control loop iteration failed; continuing")
            timeout = self.cfg.poll_interval_seconds
            if self._need_pass:
                timeout = min(timeout, max(self._next_pass_at - self.clock(), 0.0))
            self._wake.wait(timeout)
            self._wake.clear()

    def run_once(self):
        now = self.clock()
        self._drain_inbox(now)
        self._poll(now)
        self._check_running(now)
        due = self._need_pass or (self._wake_at is not None and now >= self._wake_at)
        if due and now >= self._next_pass_at:
            self._schedule(now)
        if now - self._last_flush >= PROGRESS_FLUSH_SECONDS:
            self._flush_progress()
            self._last_flush = now

    def recover(self):
        """Takes up the unfinished jobs of the store (after a restart or a crash)."""
        now = self.clock()
        for job in self.store.unfinished():
            if job.pool not in self.pools:
                job.state, job.exit_reason = job_pb2.FAILED, f"pool {job.pool!r} is not configured"
                _stamp(job.finished, now)
                self.store.update(job)
                continue
            if job.state in (job_pb2.QUEUED, job_pb2.PREEMPTED):
                self._enqueue(job)
                continue
            self._track(job, now)
            if job.stop:
                self._signal_stop(job, now)
            log.info("re-attached %s (%s, attempt %d)", job.id, _state(job), job.attempts)
        self._update_fleet()

    def _enqueue(self, job):
        self._pending[job.id] = job
        not_before = job.not_before.ToNanoseconds() / 1e9 if job.HasField("not_before") else 0.0
        r = job.spec.resources
        self._demands[job.id] = scheduler.Demand(
            job.id, int(job.id[1:]), job.spec.priority, job.pool, job.spec.team,
            r.nodes or 1, r.gpus_per_node, not_before,
        )  # fmt: skip
        self._need_pass = True

    def _track(self, job, now):
        self._running[job.id] = job
        self._started_at[job.id] = now
        snapshot = job_pb2.Job()
        snapshot.CopyFrom(job)
        with self._lock:
            self._attempts[job.id] = (job.attempts, snapshot)

    def _drain_inbox(self, now):
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "submitted":
                self._enqueue(item[1])
                self.events.publish(item[1].id)
            else:
                _, job_id, done = item
                try:
                    done.set_result(self._cancel(job_id, now))
                except Exception as e:
                    done.set_exception(e)

    def _cancel(self, job_id, now):
        if job_id in self._pending:
            job = self._pending.pop(job_id)
            del self._demands[job_id]
            job.state, job.exit_reason = job_pb2.CANCELLED, "cancelled before it started"
            _stamp(job.finished, now)
            self.store.update(job)
            self._finished(job, preempted=False)
            return job
        job = self._running.get(job_id)
        if job is None:
            return self.store.get(job_id)  # already final, or unknown (None)
        if job.stop != job_pb2.STOP_CANCEL:
            job.stop = job_pb2.STOP_CANCEL
            self.store.update(job)
            self._signal_stop(job, now)
            self.events.publish(job_id)
        return job

    def _poll(self, now):
        by_executor = {}
        for job in self._running.values():
            by_executor.setdefault(job.pool, {})[job.id] = json.loads(job.handle)
        for pool, handles in by_executor.items():
            try:
                observed = self.executors[pool].poll(handles)
            except Exception:  # one broken pool (squeue down, API server gone) stalls no other
                log.exception("polling pool %s failed; trying again next time", pool)
                continue
            for job_id, seen in observed.items():
                job = self._running[job_id]
                if seen.status == Status.RUNNING and job.state == job_pb2.STARTING:
                    job.state = job_pb2.RUNNING
                    self.store.update(job)
                    self.events.publish(job_id)
                elif seen.status not in (Status.PENDING, Status.RUNNING):
                    self._attempt_ended(job, seen, now)

    def _check_running(self, now):
        for job_id, job in list(self._running.items()):
            if job_id in self._kill_at and now >= self._kill_at[job_id]:
                log.warning("%s did not stop within %.0f s: SIGKILL", job_id, self._grace())
                self._kill_at[job_id] = now + self._grace()  # and again then, if need be
                try:
                    self.executors[job.pool].kill(json.loads(job.handle))
                except Exception:
                    log.exception("%s: kill failed; trying again in %.0f s", job_id, self._grace())
            elif job.state == job_pb2.RUNNING and not job.stop:
                timeout = job.spec.hang_timeout_seconds or self.cfg.hang_timeout_seconds
                last = max(self._started_at[job_id], self._progress.get(job_id, (None, 0.0))[1])
                if scheduler.hung(last, timeout, now):
                    try:  # a trainer whose report stream broke still writes metrics.jsonl
                        last = max(
                            last, os.path.getmtime(os.path.join(job.run_dir, "metrics.jsonl"))
                        )
                    except OSError:
                        pass
                if scheduler.hung(last, timeout, now):
                    log.warning("%s: no progress for %.0f s: restarting it", job_id, now - last)
                    job.stop = job_pb2.STOP_HANG
                    job.exit_reason = (
                        f"no progress for {now - last:.0f} s (timeout {timeout:.0f} s)"
                    )
                    self.store.update(job)
                    self._signal_stop(job, now)

    def _signal_stop(self, job, now):
        """SIGTERM now (the stop reason is already stored), SIGKILL after the grace period."""
        self._kill_at[job.id] = now + self._grace()
        try:
            self.executors[job.pool].terminate(json.loads(job.handle))
        except Exception:  # the kill at the deadline is the fallback
            log.exception("%s: terminate failed; SIGKILL follows at the deadline", job.id)

    def _grace(self):
        return self.cfg.kill_grace_seconds

    def _schedule(self, now):
        """One pass: plan, then act. Its duration (the decision, without starting processes
        or signalling them) is kitchen_scheduler_pass_duration_seconds."""
        started = time.perf_counter()
        holdings = [
            scheduler.Holding(
                job.id, job.spec.priority, job.pool, job.spec.team,
                tuple((a.node, tuple(a.gpus)) for a in job.allocation),
                self._started_at[job.id], stopping=bool(job.stop),
            )
            for job in self._running.values()
        ]  # fmt: skip
        plan = scheduler.plan(self.pools, self.quotas, self._demands.values(), holdings, now)
        with self._lock:
            changed = [j for j, r in plan.waiting.items() if self._waiting.get(j) != r]
            self._waiting = plan.waiting
        self._wake_at, self._need_pass = plan.wake_at, False
        took = time.perf_counter() - started
        self.metrics.scheduler_pass.observe(took)
        self._next_pass_at = now + PASS_SPACING * took
        for job_id in plan.preempt:
            job = self._running[job_id]
            log.info("preempting %s for a higher-priority job", job_id)
            job.stop = job_pb2.STOP_PREEMPT
            self.store.update(job)
            self._signal_stop(job, now)
            changed.append(job_id)
        for job_id, allocation in plan.start.items():
            self._start(self._pending.pop(job_id), allocation, now)
            del self._demands[job_id]
        self._update_fleet()
        self.events.publish_many(changed)

    def _start(self, job, allocation, now):
        job.attempts += 1
        handle = {"attempt_dir": attempt_dir(job.run_dir, job.attempts), "launched_at": now}
        waited = now - job.queued.ToNanoseconds() / 1e9
        job.state, job.stop, job.handle = job_pb2.STARTING, 0, json.dumps(handle)
        del job.allocation[:]
        for node, gpus in allocation:
            job.allocation.add(node=node, gpus=gpus)
        job.ClearField("not_before")
        if not job.HasField("started"):
            _stamp(job.started, now)
        token = secrets.token_urlsafe(24) if self.auth else ""
        self.store.update(job, attempt_token=token)  # durable before anything starts
        self._track(job, now)
        self.metrics.attempt_started(job, waited)
        try:
            args = self._trainer_args(job)
            launch = Launch(job, [*self.cfg.trainer_cmd, *args], self._env(token), handle, args)
            handle, status = self.executors[job.pool].start(launch)
        except Exception as e:
            log.exception("%s: could not start attempt %d", job.id, job.attempts)
            self._attempt_ended(job, Observed(Status.LOST, None, f"could not start: {e}"), now)
            return
        job.handle = json.dumps(handle)
        if status == Status.RUNNING:
            job.state = job_pb2.RUNNING
        self.store.update(job)
        log.info("%s: attempt %d %s", job.id, job.attempts, _state(job).lower())
        self.events.publish(job.id)

    def _trainer_args(self, job):
        os.makedirs(job.run_dir, exist_ok=True)
        spec = job_pb2.JobSpec()
        spec.CopyFrom(job.spec)
        spec.trainer.run_dir = job.run_dir
        spec_path = os.path.join(job.run_dir, "job.json")
        write_json_atomically(spec_path, json.loads(json_format.MessageToJson(spec)))
        return [
            "--spec", spec_path, "--run-dir", job.run_dir, "--launcher", self.cfg.advertise,
            "--job-id", job.id, "--attempt", str(job.attempts),
        ]  # fmt: skip

    def _env(self, token):
        env = {**self.env, "KITCHEN_STATE_DIR": self.cfg.state_dir, "PYTHONUNBUFFERED": "1"}
        if token:
            env["KITCHEN_LAUNCHER_TOKEN"] = token
        if self.cfg.tls_cert:
            env["KITCHEN_LAUNCHER_TLS_CA"] = self.cfg.tls_cert
        return env

    def _attempt_ended(self, job, seen: Observed, now):
        detail = seen.detail
        if not detail and seen.exit_code not in (0, None):
            detail = last_line(os.path.join(json.loads(job.handle)["attempt_dir"], "output.log"))
        if job.stop == job_pb2.STOP_HANG:
            detail = job.exit_reason
        never = seen.status == Status.NEVER_STARTED
        out = scheduler.after_exit(job, seen.exit_code, detail, now, never_started=never)
        with self._lock:
            self._attempts.pop(job.id, None)
            latest = self._progress.pop(job.id, None)
            self._dirty.discard(job.id)
        if latest is not None:
            job.progress.CopyFrom(latest[0])
            _stamp(job.last_progress, latest[1])
        job.state, job.exit_reason, job.stop, job.handle = out.state, out.reason, 0, ""
        job.failures += int(out.failed)
        job.preemptions += int(out.preempted)
        job.attempts -= int(never)
        del job.allocation[:]
        if out.state in FINAL:
            _stamp(job.finished, now)
        else:
            _stamp(job.queued, now)
            if out.not_before:
                _stamp(job.not_before, out.not_before)
        self.store.update(job)
        del self._running[job.id]
        self._started_at.pop(job.id, None)
        self._kill_at.pop(job.id, None)
        log.info("%s: attempt %d ended: %s", job.id, job.attempts, out.reason)
        if out.state in FINAL:
            self._finished(job, out.preempted)
        else:
            self._enqueue(job)
            self.metrics.attempt_ended(job, out.preempted)
            self.events.publish(job.id)

    def _finished(self, job, preempted):
        self.metrics.attempt_ended(job, preempted)
        self._need_pass = True
        self._update_fleet()
        self.events.publish(job.id)
        self.events.forget(job.id)

    def _flush_progress(self):
        with self._lock:
            dirty = [(j, self._progress[j]) for j in self._dirty if j in self._progress]
            self._dirty.clear()
        for job_id, (progress, received) in dirty:
            job = self._running.get(job_id)
            if job is not None:
                job.progress.CopyFrom(progress)
                _stamp(job.last_progress, received)
                self.store.update(job)

    def _update_fleet(self):
        queued = {}
        for d in self._demands.values():
            queued[d.pool] = queued.get(d.pool, 0) + 1
        pools = {
            name: {
                "nodes_capacity": p.nodes, "gpus_capacity": p.nodes * p.gpus_per_node,
                "nodes_in_use": 0, "gpus_in_use": 0,
            }
            for name, p in self.pools.items()
        }  # fmt: skip
        for job in self._running.values():
            pools[job.pool]["nodes_in_use"] += len(job.allocation)
            pools[job.pool]["gpus_in_use"] += sum(len(a.gpus) for a in job.allocation)
        with self._lock:
            self._fleet = {"queued": queued, "pools": pools}


def _state(job):
    return job_pb2.JobState.Name(job.state)
