"""The launcher's MLflow writer against a real `mlflow server` on 127.0.0.1 (one per file):
killed mid-run and restarted, no value is lost; a refused batch is set aside; the spool stays
under its bound."""

import logging
import math
import os
import time

import pytest
from mlflow.tracking import MlflowClient

from launcher.metrics import LauncherMetrics
from launcher.tracking import records
from launcher.tracking.spool import Batch, Spool
from launcher.tracking.testing import MlflowServer
from launcher.tracking.tracker import Tracker
from protos import job_pb2, launcher_pb2, progress_pb2

STEPS = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with MlflowServer(str(tmp_path_factory.mktemp("mlflow"))) as s:
        yield s


def _job(tmp_path, job_id="j1", lr=3e-4) -> job_pb2.Job:
    spec = job_pb2.JobSpec(name="tiny", kind=job_pb2.PRETRAIN, team="vision", owner="ada")
    spec.trainer.optim.lr = lr
    run_dir = tmp_path / "runs" / job_id
    (run_dir / "checkpoints" / "step_00000060").mkdir(parents=True, exist_ok=True)
    (run_dir / "loss.png").write_bytes(b"\x89PNG not really")
    (run_dir / "checkpoints" / "step_00000060" / "meta.json").write_text(
        '{"step": 60, "files": {"model.pt": {"bytes": 3, "sha256": "ab12"}}}'
    )
    return job_pb2.Job(id=job_id, spec=spec, run_dir=str(run_dir), attempts=1)


def _tracker(tmp_path, uri, max_bytes=1 << 20) -> tuple[Tracker, LauncherMetrics]:
    cfg = launcher_pb2.LauncherConfig(state_dir=str(tmp_path / "state"))
    cfg.tracking.uri, cfg.tracking.spool_max_bytes, cfg.tracking.flush_seconds = uri, max_bytes, 0.2
    metrics = LauncherMetrics(60)
    return Tracker(cfg, metrics.registry), metrics


def _report(step: int) -> progress_pb2.Progress:
    return progress_pb2.Progress(
        job_id="j1", attempt=1, phase="train", step=step, total_steps=STEPS,
        loss=5.0 - step / 100, lr=3e-4, step_time_seconds=0.05, tokens_per_second=4000,
    )  # fmt: skip


def _wait(predicate, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError("condition not met")


def test_server_killed_mid_run_loses_nothing(server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "kitchen.tracking")
    tracker, metrics = _tracker(tmp_path, server.uri)
    job = _job(tmp_path)
    tracker.start()
    tracker.job_started(job)
    for step in range(1, STEPS + 1):
        if step == 20:
            _wait(lambda: not tracker.spool.pending())  # the first steps reached MLflow
            server.kill()
        if step == 40:
            server.start()  # same port, same store
        started = time.monotonic()
        tracker.progress(job, _report(step))
        assert time.monotonic() - started < 0.1  # the trainer's report is never held up
        time.sleep(0.05)
    job.state = job_pb2.SUCCEEDED
    tracker.job_ended(job)
    _wait(lambda: not tracker.spool.pending())
    tracker.stop()

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("kitchen/vision")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id], "tags.`kitchen.job_id` = 'j1'")
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert all(math.isclose(m.value, 5.0 - m.step / 100) for m in history)
    assert run.data.params["trainer.optim.lr"] == "0.0003"
    assert run.data.params["trainer.model.dim"]  # a default applied, not only what was set
    assert run.data.tags["kitchen.team"] == "vision"
    assert "ab12" in run.data.tags["kitchen.checkpoint.step_00000060"]
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plots", "config", "checkpoints"} <= artifacts
    failures = metrics.registry.get_sample_value("kitchen_tracking_send_failures_total")
    assert failures is not None and failures >= 1
    assert any("cannot send to MLflow" in r.message for r in caplog.records)
    assert any("answers again" in r.message for r in caplog.records)


def test_refused_batch_is_set_aside(server, tmp_path, caplog):
    """MLflow refuses to change a logged param (400): that batch is kept aside, not retried
    for ever, and the ones after it are sent."""
    tracker, metrics = _tracker(tmp_path, server.uri)
    tracker.job_started(_job(tmp_path, "j2", lr=1e-3))
    tracker.job_started(_job(tmp_path, "j2", lr=2e-3))
    tracker.progress(_job(tmp_path, "j2"), _report(1))
    tracker._flush_buffer()
    assert tracker.drain() == 2
    assert not tracker.spool.pending()
    assert len(os.listdir(os.path.join(tracker.spool.dir, "rejected"))) == 1
    assert metrics.registry.get_sample_value("kitchen_tracking_dropped_batches_total") == 1


def test_spool_stays_bounded(tmp_path):
    spool = Spool(str(tmp_path / "spool"), max_bytes=4000)
    point = records.Point("loss", 1.0, 1, 0)
    dropped = sum(spool.put(Batch("j", "kitchen/t", points=[point] * 20)) for _ in range(30))
    sizes = [os.path.getsize(p) for p in spool.pending()]
    assert dropped == 30 - len(sizes) > 0
    assert sum(sizes) <= 4000
    # A restarted launcher continues the numbering after what is left.
    again = Spool(spool.dir, max_bytes=4000)
    again.put(Batch("j", "kitchen/t"))
    assert again.pending()[-1] > spool.pending()[-2]
