"""The executor side of the launcher's live attempts: start one, poll them, stop them, notice a
hang. State changes are the controller's; this module only talks to executors and files.

Starting writes the attempt's handoff files (launcher/executors/handoff.py: attempt.json, the
token file) and hands the executor a Launch: `<trainer_cmd> --attempt <attempt_dir>/attempt.json`
with an environment that holds no job fact and no secret (PYTHONUNBUFFERED, plus what the
launcher was given for trainers: PYTHONPATH for runs on this host). A pool whose poll fails is
held back with a doubling delay; signals that fail are logged once (the SIGKILL at the deadline
is the fallback of a failed SIGTERM).
"""

import os

from launcher import scheduler
from launcher.executors import handoff, task_array
from launcher.executors.base import Launch, Observed, Status, last_line
from launcher.faults import ErrorLog, Holds
from launcher.unfinished import LiveAttempt
from protos import hang_report, job_pb2, launcher_pb2
from protos.attempt_file import OUTPUT_LOG


class Attempts:
    def __init__(
        self,
        cfg: launcher_pb2.LauncherConfig,
        executors: dict,
        env: dict,
        errors: ErrorLog,
        holds: Holds,
    ):
        self.cfg = cfg  # resolved
        self.executors = executors  # pool name -> Executor
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self.errors = errors
        self.holds = holds

    def start(self, job: job_pb2.Job, handle: dict, token: str) -> tuple[dict, Status]:
        """Writes the handoff, starts the attempt; returns the executor's handle and status."""
        attempt = handoff.write(job, self.cfg, handle["attempt_dir"], token)
        launch = Launch(job, attempt, list(self.cfg.trainer_cmd), self.env, handle)
        return self.executors[job.pool].start(launch)

    def poll(self, live: dict[str, LiveAttempt], now: float) -> list[tuple[str, Observed]]:
        """What the executors see of `live` attempts, one call per pool not held back."""
        by_pool: dict[str, dict[str, dict]] = {}
        for job_id, attempt in live.items():
            by_pool.setdefault(attempt.job.pool, {})[job_id] = attempt.handle
        seen = []
        for pool, handles in by_pool.items():
            key = f"polling pool {pool}"
            if self.holds.held(key, now):
                continue
            try:
                observed = self.executors[pool].poll(handles)
            except Exception as e:  # one broken pool (squeue down, API server gone) stalls no other
                self.errors.failed(key, e)
                self.holds.hold(key, e, now)
                continue
            self.holds.clear(key)
            self.errors.recovered(key)
            seen.extend(observed.items())
        return seen

    def terminate(self, live: LiveAttempt):
        self._signal("terminate", live)

    def kill(self, live: LiveAttempt):
        self._signal("kill", live)

    def _signal(self, how: str, live: LiveAttempt):
        try:
            getattr(self.executors[live.job.pool], how)(live.handle)
        except Exception as e:
            self.errors.failed(how, e, live.job.id)

    def hang_reason(self, live: LiveAttempt, now: float) -> str:
        """Why a running attempt counts as hung ("": it does not)."""
        job = live.job
        timeout = job.spec.hang_timeout_seconds or self.cfg.hang_timeout_seconds
        last = max(live.started_at, live.progress_at)
        if scheduler.hung(last, timeout, now):
            try:  # a trainer whose report stream broke still writes metrics.jsonl
                last = max(last, os.path.getmtime(os.path.join(job.run_dir, "metrics.jsonl")))
            except OSError:
                pass
            if "precook_tasks" in live.handle:  # a PRECOOK job's steps: alive while they log
                last = max(last, task_array.last_output(live.handle["attempt_dir"]))
        if not scheduler.hung(last, timeout, now):
            return ""
        reason = f"no progress for {now - last:.0f} s (timeout {timeout:.0f} s)"
        found = self.trainer_hang_report(live)
        return f"{reason}; the trainer's watchdog: {found}" if found else reason

    def trainer_hang_report(self, live: LiveAttempt) -> str:
        """The message of this attempt's trainer hang report (trainer/health/watchdog.py: it
        names the stuck rank and the stack dumps), or ""."""
        try:
            report = hang_report.read_report(live.job.run_dir)
        except ValueError as e:
            return str(e)
        if report is None or report.written_at < live.started_at:
            return ""  # none, or an earlier attempt's
        return report.message

    def end_detail(self, live: LiveAttempt, seen: Observed) -> str:
        """What to say about an ended attempt: the executor's words, else the log's last line."""
        if live.job.stop == job_pb2.STOP_HANG:
            return live.job.exit_reason
        if seen.exit_code not in (0, None) and (found := self.trainer_hang_report(live)):
            return found
        if not seen.detail and seen.exit_code not in (0, None):
            return last_line(os.path.join(live.handle["attempt_dir"], OUTPUT_LOG))
        return seen.detail
