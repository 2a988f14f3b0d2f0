"""MoE gauges on /metrics: from the latest record that has MoE statistics, per layer too; an
evaluation record in between does not reset them; a dense job has none."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from launcher.metrics import LauncherMetrics
from protos import job_pb2, progress_pb2

LABELS = {"job_id": "j9", "name": "moe", "kind": "pretrain", "pool": "cpu", "team": "nlp"}


def _samples(m) -> dict:
    out = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            out[(s.name, s.labels.get("layer"))] = s.value
    return out


def _job(job_id="j9", name="moe"):
    job = job_pb2.Job(id=job_id, pool="cpu", state=job_pb2.RUNNING)
    job.spec.name, job.spec.kind, job.spec.team = name, job_pb2.PRETRAIN, "nlp"
    return job


def _train(step, imbalance):
    layers = [
        progress_pb2.MoeLayerStats(layer=1, imbalance=1.2, aux_loss=1.01),
        progress_pb2.MoeLayerStats(layer=3, imbalance=imbalance, aux_loss=1.5),
    ]
    return progress_pb2.Progress(
        attempt=1, step=step, phase="train", moe_layers=layers, moe_max_imbalance=imbalance,
        moe_dropped_fraction=0.02, moe_min_router_entropy=0.4,
    )  # fmt: skip


def test_moe_gauges_survive_eval_records_and_dense_jobs_have_none():
    m = LauncherMetrics(retention_seconds=60)
    m.progress(_job(), _train(10, 2.0))
    m.progress(_job(), _train(20, 3.9))
    m.progress(_job(), progress_pb2.Progress(attempt=1, step=20, phase="eval", eval_loss=5.0))
    m.progress(_job("j10", "dense"), progress_pb2.Progress(attempt=1, step=5, loss=3.0))
    got = _samples(m)
    assert got[("kitchen_train_moe_max_imbalance", None)] == 3.9
    assert got[("kitchen_train_moe_dropped_ratio", None)] == 0.02
    assert got[("kitchen_train_moe_min_router_entropy", None)] == 0.4
    assert got[("kitchen_train_moe_layer_imbalance", "1")] == 1.2
    assert got[("kitchen_train_moe_layer_imbalance", "3")] == 3.9
    assert got[("kitchen_train_moe_layer_aux_loss", "3")] == 1.5
    families = list(text_string_to_metric_families(generate_latest(m.registry).decode()))
    moe_jobs = {
        s.labels["job_id"]
        for f in families
        if f.name.startswith("kitchen_train_moe")
        for s in f.samples
    }
    assert moe_jobs == {"j9"}
