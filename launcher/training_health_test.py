"""Training health in the launcher: per-rank series with a bounded `rank` label, the
trainer's hang report (which names the stuck rank and the stack dumps) in the job's status,
and what counts as a sign of life for the hang detector."""

import logging
import os
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from launcher import settings
from launcher.attempts import Attempts
from launcher.executors import task_array
from launcher.executors.base import Observed, Status, attempt_dir
from launcher.faults import ErrorLog, Holds
from launcher.metrics import RANK_SERIES_LIMIT, LauncherMetrics
from launcher.unfinished import LiveAttempt
from protos import hang_report, job_pb2, launcher_pb2, progress_pb2
from protos.precook_steps import PrecookStep


def rank_samples(metrics: LauncherMetrics, name: str) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.labels["rank"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_ranks_are_exported_with_a_bounded_rank_label():
    job = job_pb2.Job(id="j1", pool="cpu", state=job_pb2.RUNNING)
    job.spec.name, job.spec.kind = "big", job_pb2.PRETRAIN
    ranks = [
        progress_pb2.RankHealth(rank=r, host=f"node-{r // 8}", straggler_score=1.0 + r / 1000)
        for r in range(64)
    ]
    ranks[17].straggler_score = 3.2  # the straggler
    ranks[40].sdc_mismatches = 1  # lost a replica check (a low score: exported anyway)
    ranks[40].straggler_score = 0.9
    metrics = LauncherMetrics(retention_seconds=60)
    metrics.progress(job, progress_pb2.Progress(step=10, attempt=1, ranks=ranks, sdc_rollbacks=1))
    # A record without ranks (an event line) keeps the last ranks.
    metrics.progress(job, progress_pb2.Progress(step=10, attempt=1, message="saved"))
    scores = rank_samples(metrics, "kitchen_train_rank_straggler_score")
    assert len(scores) == RANK_SERIES_LIMIT
    assert scores["17"] == 3.2 and "40" in scores
    assert set(scores) == {"40", "17", "63", "62", "61", "60", "59", "58"}
    assert rank_samples(metrics, "kitchen_train_rank_sdc_mismatches")["40"] == 1
    text = generate_latest(metrics.registry).decode()
    assert 'kitchen_train_sdc_rollbacks_total{job_id="j1"' in text
    assert 'host="node-2",job_id="j1",kind="pretrain",name="big",pool="cpu",rank="17"' in text


def attempts_with_report(tmp_path, written_at: float):
    run_dir = tmp_path / "run"
    report = hang_report.HangReport(
        step=7,
        stuck_ranks=[3],
        stuck_hosts=["node-0"],
        idle_seconds=12.0,
        dumps=hang_report.hang_dir(str(run_dir)),
        message=f"hang: rank 3 on node-0 stopped; stacks: {run_dir}/hang/rank-*.txt",
        written_at=written_at,
    )
    (run_dir / "hang").mkdir(parents=True)
    hang_report.write_report(str(run_dir), report)
    cfg = settings.resolve(launcher_pb2.LauncherConfig())
    attempts = Attempts(cfg, {}, {}, ErrorLog(logging.getLogger("t")), Holds())
    job = job_pb2.Job(id="j2", run_dir=str(run_dir), state=job_pb2.RUNNING)
    job.spec.hang_timeout_seconds = 5
    return attempts, report, job


def test_a_failed_attempt_says_what_the_trainer_watchdog_found(tmp_path):
    started = time.time() - 60
    attempts, report, job = attempts_with_report(tmp_path, written_at=started + 50)
    live = LiveAttempt(job, {"attempt_dir": str(tmp_path)}, started_at=started)
    assert attempts.end_detail(live, Observed(Status.EXITED, 1, "")) == report.message
    # The launcher's own hang detector links the report too.
    reason = attempts.hang_reason(live, started + 70)
    assert reason.startswith("no progress for 70 s (timeout 5 s); the trainer's watchdog: hang")
    assert f"{job.run_dir}/hang/rank-*.txt" in reason


def test_an_earlier_attempts_report_is_not_this_attempts_story(tmp_path):
    started = time.time()
    attempts, _, job = attempts_with_report(tmp_path, written_at=started - 600)
    live = LiveAttempt(job, {"attempt_dir": str(tmp_path)}, started_at=started)
    (tmp_path / "output.log").write_text("RuntimeError: boom\n")
    assert attempts.end_detail(live, Observed(Status.EXITED, 1, "")) == "RuntimeError: boom"
    assert attempts.hang_reason(live, started + 70) == "no progress for 70 s (timeout 5 s)"


def test_a_precook_task_that_logs_is_alive_and_a_silent_one_hangs(tmp_path):
    """A PRECOOK job's steps send no progress reports: a task step's log line (the progress
    line trainer/data/tasks.py writes every few seconds) is its sign of life."""
    started = time.time() - 3600
    attempts = Attempts(
        settings.resolve(launcher_pb2.LauncherConfig()),
        {},
        {},
        ErrorLog(logging.getLogger("t")),
        Holds(),
    )
    job = job_pb2.Job(id="j3", run_dir=str(tmp_path), state=job_pb2.RUNNING)
    job.spec.kind, job.spec.hang_timeout_seconds = job_pb2.PRECOOK, 600
    d = attempt_dir(str(tmp_path), 1)
    live = LiveAttempt(job, {"attempt_dir": d, "precook_tasks": 4}, started_at=started)
    log = os.path.join(task_array.step_dir(d, PrecookStep.TASK, 2), "output.log")
    os.makedirs(os.path.dirname(log))
    with open(log, "w") as f:
        f.write("  task 2: tokenize  1,200/48,000 records (  2%)  ...\n")
    os.utime(log, (started + 3300, started + 3300))  # 5 minutes ago
    assert attempts.hang_reason(live, started + 3600) == ""
    os.utime(log, (started + 2400, started + 2400))  # 20 minutes ago: past the timeout
    assert attempts.hang_reason(live, started + 3600) == "no progress for 1200 s (timeout 600 s)"
    # Another kind of job is not kept alive by such a log.
    os.utime(log, (started + 3300, started + 3300))
    other = LiveAttempt(job, {"attempt_dir": d}, started_at=started)
    assert attempts.hang_reason(other, started + 3600) == "no progress for 3600 s (timeout 600 s)"
