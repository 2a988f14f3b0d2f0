"""The launcher's wiring to its MLflow writer: a real launcher (fake trainer, torch-free)
writing its embedded store. The controller hands the tracker each attempt's start, each report
as the trainer sent it, and the end; the run holds every step once, the spec and the status."""

import math

from mlflow.tracking import MlflowClient

from launcher.settings import embedded_tracking_uri
from launcher.testdata import harness as h
from protos import job_pb2

STEPS = 12


def test_a_launchers_job_is_a_run_in_its_embedded_store(tmp_path):
    cfg = h.config(tmp_path)
    cfg.tracking.uri = ""  # the default: the embedded store (the harness turns it off)
    cfg.tracking.flush_seconds = 0.2
    with h.started(cfg) as (launcher, client):
        job = client.submit(h.spec("tracked", steps=STEPS, team="nlp", owner="ada"))
        done = h.wait_for(client, job.id, h.FINAL, timeout=60)
        assert done.state == job_pb2.SUCCEEDED
        tracker = launcher.tracker
        assert tracker is not None
        h.wait_until(lambda: not tracker.spool.pending(), "the spool sent", timeout=120)
    mlflow = MlflowClient(embedded_tracking_uri(cfg.state_dir))
    experiment = mlflow.get_experiment_by_name("kitchen/nlp")
    assert experiment is not None
    (run,) = mlflow.search_runs([experiment.experiment_id])
    loss = mlflow.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(1, STEPS + 1))
    assert all(math.isclose(m.value, 10.0 / m.step) for m in loss)  # the fake trainer's loss
    assert run.data.params["trainer.train.steps"] == str(STEPS)
    assert run.data.tags["kitchen.job_id"] == job.id
    assert run.data.tags["kitchen.owner"] == "ada"
    assert run.info.run_name == "tracked"
    assert run.info.status == "FINISHED"
