"""The Prometheus exporter: series per job, launcher-wide series, bounded cardinality."""

import math
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from launcher.metrics import LauncherMetrics
from launcher.server import Launcher
from launcher.testdata import harness as h
from protos import job_pb2, metric_catalog, progress_pb2

ISSUE_METRICS = [
    "kitchen_train_step_duration_seconds", "kitchen_train_mfu_ratio", "kitchen_train_tokens",
    "kitchen_train_tokens_per_second", "kitchen_train_loss", "kitchen_train_goodput_ratio",
    "kitchen_jobs", "kitchen_queue_depth", "kitchen_job_queue_wait_seconds", "kitchen_job_attempts",
    "kitchen_scheduler_pass_duration_seconds",
]  # fmt: skip


def samples(text):
    """{(sample name, frozenset(labels)): value} of a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(port) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def make_job():
    job = job_pb2.Job(id="j7", pool="cpu", state=job_pb2.RUNNING)
    job.spec.name, job.spec.kind, job.spec.team = "tiny", job_pb2.PRETRAIN, "nlp"
    return job


LABELS = frozenset(
    {"job_id": "j7", "name": "tiny", "kind": "pretrain", "pool": "cpu", "team": "nlp"}.items()
)


def test_step_histogram_counts_steps_and_retention_drops_finished_jobs():
    now = [100.0]
    m = LauncherMetrics(retention_seconds=60, clock=lambda: now[0])
    job = make_job()
    m.attempt_started(job, waited_seconds=3.0)
    for step, seconds in ((10, 0.2), (20, 0.2), (30, 3.0)):
        m.progress(
            job, progress_pb2.Progress(attempt=1, step=step, step_time_seconds=seconds, loss=2.0)
        )
    got = samples(generate_latest(m.registry).decode())
    assert got[("kitchen_train_step_duration_seconds_count", LABELS)] == 21  # 1 + 10 + 10 steps
    assert got[("kitchen_train_step_duration_seconds_bucket", LABELS | {("le", "0.25")})] == 11
    assert math.isnan(got[("kitchen_train_eval_loss", LABELS)])  # no eval yet: not zero
    assert got[("kitchen_job_attempts_total", LABELS)] == 1
    assert (
        got[
            (
                "kitchen_job_queue_wait_seconds_count",
                frozenset({"pool": "cpu", "team": "nlp"}.items()),
            )
        ]
        == 1
    )
    job.state = job_pb2.SUCCEEDED
    m.attempt_ended(job, preempted=False)
    now[0] += 59
    assert ("kitchen_train_loss", LABELS) in samples(generate_latest(m.registry).decode())
    now[0] += 2
    assert not any(
        dict(labels).get("job_id") == "j7"
        for _, labels in samples(generate_latest(m.registry).decode())
    )


def test_a_resumed_attempt_counts_its_steps_again():
    m = LauncherMetrics(retention_seconds=60)
    job = make_job()
    m.progress(job, progress_pb2.Progress(attempt=1, step=10, step_time_seconds=0.1))
    m.progress(job, progress_pb2.Progress(attempt=1, step=20, step_time_seconds=0.1))
    m.progress(job, progress_pb2.Progress(attempt=2, step=12, step_time_seconds=0.1))  # from ckpt
    m.progress(job, progress_pb2.Progress(attempt=2, step=20, step_time_seconds=0.1))
    got = samples(generate_latest(m.registry).decode())
    assert got[("kitchen_train_step_duration_seconds_count", LABELS)] == 11 + 9


def test_scrape_a_live_launcher(tmp_path):
    cfg = h.config(tmp_path, metrics_retention_seconds=1.0)
    with h.started(cfg) as (launcher, client):
        h.behave(tmp_path, "long", steps=10_000, step_seconds=0.02)
        running = client.submit(h.spec("long", team="nlp"))
        queued = client.submit(h.spec("next", team="nlp"))
        h.wait_for_step(client, running.id, 5)
        h.wait_for(client, queued.id, [job_pb2.QUEUED])
        text = scrape(launcher.metrics_port)
        names = {f.name for f in text_string_to_metric_families(text)}
        assert set(ISSUE_METRICS) <= names, set(ISSUE_METRICS) - names
        got = samples(text)
        labels = frozenset(
            {
                "job_id": running.id,
                "name": "long",
                "kind": "pretrain",
                "pool": "cpu",
                "team": "nlp",
            }.items()
        )
        assert got[("kitchen_train_mfu_ratio", labels)] == 0.25
        assert got[("kitchen_train_tokens_total", labels)] >= 5 * 64
        assert got[("kitchen_queue_depth", frozenset({"pool": "cpu"}.items()))] == 1
        assert got[("kitchen_jobs", frozenset({"state": "RUNNING", "pool": "cpu"}.items()))] == 1
        assert (
            got[("kitchen_pool_in_use", frozenset({"pool": "cpu", "resource": "nodes"}.items()))]
            == 1
        )
        assert got[("kitchen_scheduler_pass_duration_seconds_count", frozenset())] >= 1
        for job in (running, queued):
            client.cancel(job.id)
            h.wait_for(client, job.id, h.FINAL)
        time.sleep(1.5)  # past the retention window
        after = samples(scrape(launcher.metrics_port))
        assert not any(dict(lbl).get("job_id") in (running.id, queued.id) for _, lbl in after)
        # Every state is exported for the pool, 0 included: "none running" is 0, not no data.
        cpu_jobs = {
            dict(lbl)["state"]: n
            for (name, lbl), n in after.items()
            if name == "kitchen_jobs" and dict(lbl)["pool"] == "cpu"
        }
        states = [s for s in job_pb2.JobState.keys() if s != "JOB_STATE_UNSPECIFIED"]
        assert cpu_jobs == {state: 2 if state == "CANCELLED" else 0 for state in states}


def test_a_shared_launchers_metrics_need_the_token_and_hide_job_names(tmp_path):
    token_file = tmp_path / "metrics-token"
    token_file.write_text("scrape-0123456789abcdef\n")
    cfg = h.config(tmp_path, tokens_file=h.admin_tokens_file(tmp_path))
    cfg.exposure.metrics_token_file = str(token_file)
    launcher = Launcher(cfg).start()
    try:
        url = f"http://127.0.0.1:{launcher.metrics_port}/metrics"
        for header in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(urllib.request.Request(url, headers=header), timeout=10)
            assert err.value.code == 401 and b"kitchen_" not in err.value.read()
        request = urllib.request.Request(
            url, headers={"Authorization": "Bearer scrape-0123456789abcdef"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert b"kitchen_scheduler_pass_duration_seconds" in r.read()
    finally:
        launcher.stop()
    hidden = LauncherMetrics(retention_seconds=60, job_names=False)
    hidden.progress(make_job(), progress_pb2.Progress(attempt=1, step=1, step_time_seconds=0.1))
    names = {dict(lbl).get("name") for _, lbl in samples(generate_latest(hidden.registry).decode())}
    assert names == {None, "j7"}  # the job id stands where the name was


def test_rl_series_keep_their_newest_value_and_only_rl_jobs_have_them():
    """#14: a PPO job's train and eval reports carry different RL fields; each series keeps its
    newest non-zero value. A pretraining job exports no kitchen_rl_* series at all."""
    m = LauncherMetrics(retention_seconds=60)
    ppo = make_job()
    ppo.id, ppo.spec.kind = "j8", job_pb2.PPO
    m.progress(make_job(), progress_pb2.Progress(attempt=1, step=1, loss=2.0))
    m.progress(ppo, progress_pb2.Progress(attempt=1, step=5, kl=1.5, reward_mean=0.25))
    m.progress(ppo, progress_pb2.Progress(attempt=1, step=5, phase="eval", pass_rate=0.4))
    m.progress(ppo, progress_pb2.Progress(attempt=1, step=10, kl=3.0, reward_mean=0.5))
    got = samples(generate_latest(m.registry).decode())
    labels = frozenset(dict(LABELS, job_id="j8", kind="ppo").items())
    assert got[("kitchen_rl_kl", labels)] == 3.0
    assert got[("kitchen_rl_reward_mean", labels)] == 0.5
    assert got[("kitchen_rl_pass_rate_ratio", labels)] == 0.4
    rl_series = {name for name, lab in got if name.startswith("kitchen_rl_")}
    assert all(lab == labels for name, lab in got if name in rl_series)
    assert ("kitchen_rl_entropy", labels) not in got  # never reported


def test_eval_scores_are_a_gauge_per_task_metric_and_step():
    m = LauncherMetrics(retention_seconds=60)
    job = make_job()
    for step, acc in ((40, 0.3), (80, 0.45)):
        p = progress_pb2.Progress(attempt=1, phase="eval", step=step, eval_loss=5.0)
        p.eval_scores.add(task="kitchen_next_line", metric="acc", value=acc)
        m.progress(job, p)
    got = samples(generate_latest(m.registry).decode())
    for label, acc in (("40", 0.3), ("80", 0.45)):
        labels = LABELS | {("task", "kitchen_next_line"), ("metric", "acc"), ("step", label)}
        assert got[("kitchen_eval_score", labels)] == acc


def test_a_new_metric_needs_only_its_catalog_line(monkeypatch):
    """#30: a metric reaches /metrics from its protos/metric_catalog.py entry alone.
    gradient_noise_scale, a Progress field the catalog does not export, stands in for a new
    kind's new field."""
    new = metric_catalog.Metric(
        "gradient_noise_scale",
        "kitchen_train_gradient_noise_scale",
        "B_simple, in samples.",
        metric_catalog.TRAINING,
        metric_catalog.Series.NEWEST_NONZERO,
    )
    monkeypatch.setattr(metric_catalog, "CATALOG", (*metric_catalog.CATALOG, new))
    m = LauncherMetrics(retention_seconds=60)
    m.progress(make_job(), progress_pb2.Progress(attempt=1, step=1, gradient_noise_scale=512.0))
    m.progress(make_job(), progress_pb2.Progress(attempt=1, step=2, loss=2.0))  # 0: keeps 512
    got = samples(generate_latest(m.registry).decode())
    assert got[("kitchen_train_gradient_noise_scale", LABELS)] == 512.0


def test_a_job_has_only_the_series_of_its_kind():
    """A metric is exported for the kinds its catalog entry names: a serve job's heartbeat
    brings no zero training series, a pretraining job no zero serve series; an eval job has its
    checkpoint's step and eval loss, not a training loss."""
    m = LauncherMetrics(retention_seconds=60)
    serve, evaluation = make_job(), make_job()
    serve.id, serve.spec.kind = "j8", job_pb2.SERVE
    evaluation.id, evaluation.spec.kind = "j9", job_pb2.EVAL
    m.progress(make_job(), progress_pb2.Progress(attempt=1, step=3, loss=2.0))
    m.progress(serve, progress_pb2.Progress(attempt=1, running_requests=2, kv_blocks_free=7))
    m.progress(evaluation, progress_pb2.Progress(attempt=1, step=40, eval_loss=4.5))
    names: dict[str, set[str]] = {}
    for name, labels in samples(generate_latest(m.registry).decode()):
        names.setdefault(dict(labels).get("job_id", ""), set()).add(name)
    assert {"kitchen_train_loss", "kitchen_train_step"} <= names["j7"]
    assert not any(n.startswith("kitchen_serve_") for n in names["j7"])
    assert {"kitchen_serve_running_requests", "kitchen_serve_kv_blocks_free"} <= names["j8"]
    assert not any(n.startswith("kitchen_train_") for n in names["j8"])
    assert {"kitchen_train_step", "kitchen_train_eval_loss"} <= names["j9"]
    assert "kitchen_train_loss" not in names["j9"]
