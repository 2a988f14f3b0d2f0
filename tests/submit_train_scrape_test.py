"""The whole chain, every part real: `submit` sends a YAML job to a running launcher, the
launcher runs the real trainer, the trainer streams progress back, and a real Prometheus
scraping the launcher's /metrics answers every dashboard panel query and recording rule.

Grafana cannot be installed here; the dashboards' queries checked through Prometheus's HTTP
API stand in for it (observability/checks.py)."""

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from observability.checks import check_queries_against
from observability.prometheus_server import free_port, running_prometheus
from observability.queries import all_queries
from protos import job_pb2
from protos.metric_catalog import CATALOG

JOB = """\
name: chain
kind: pretrain
team: research
trainer:
  data: {seq_len: 64, vocab_size: 512, max_documents: 200}
  model: {dim: 64, n_layers: 2, n_heads: 4, moe_experts: 4}  # experts: the MoE panels have data
  train: {steps: 40, micro_batch: 4, log_every: 2, eval_every: 20, eval_batches: 2}
  checkpoint: {every_steps: 20}
"""


def _env(state_dir):
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_NUM_THREADS": "2",
        "KITCHEN_STATE_DIR": str(state_dir),
    }


def _query(prometheus_url: str, expr: str) -> list[dict]:
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


@pytest.fixture
def launcher(tmp_path):
    grpc_port, metrics_port = free_port(), free_port()
    log = open(tmp_path / "launcher.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.server",
            f"--listen=127.0.0.1:{grpc_port}",
            f"--metrics-listen=127.0.0.1:{metrics_port}",
            f"--state-dir={tmp_path / 'state'}",
        ],
        env=_env(tmp_path / "state"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"127.0.0.1:{grpc_port}", f"127.0.0.1:{metrics_port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_submitted_job_trains_and_every_dashboard_query_has_data(tmp_path, launcher):
    address, metrics_target = launcher
    config = tmp_path / "chain.yaml"
    config.write_text(JOB)
    (tmp_path / "prometheus").mkdir()
    with running_prometheus([metrics_target], tmp_path / "prometheus") as prometheus:
        started = time.monotonic()
        submit = subprocess.run(
            [
                sys.executable,
                "-m",
                "launcher.submit",
                "--config",
                str(config),
                "--launcher",
                address,
            ],
            env=_env(tmp_path / "state"),
            capture_output=True,
            text=True,
            timeout=400,
        )
        log = (tmp_path / "launcher.log").read_text()
        assert submit.returncode == 0, submit.stdout + submit.stderr + log
        assert "SUCCEEDED" in submit.stdout

        # What the trainer reported reached Prometheus, labelled by job_id.
        loss = _query(prometheus, 'kitchen_train_loss{job_id="j1"}')
        assert loss and 0 < float(loss[0]["value"][1]) < 7.0, loss
        tokens = _query(prometheus, 'kitchen_train_tokens_total{job_id="j1"}')
        assert tokens and float(tokens[0]["value"][1]) == 40 * 4 * 64, tokens
        steps = _query(prometheus, 'kitchen_train_step_duration_seconds_count{job_id="j1"}')
        assert steps and float(steps[0]["value"][1]) > 0, steps

        # Every panel query, template variable and recording rule returns data; every alert
        # expression parses and evaluates.
        # Series that only other kinds report (RL, VLM, serve: protos/metric_catalog.py says
        # which) are not this pretraining chain's: observability/checks_test.py checks them
        # against simulated jobs of those kinds.
        others = {m.sample for m in CATALOG if m.kinds and job_pb2.PRETRAIN not in m.kinds}
        queries = [q for q in all_queries() if not any(name in q.expr for name in others)]
        failures = check_queries_against(prometheus, queries=queries, wait_s=60)
        assert failures == [], "\n".join(failures)
        print(f"chain checked in {time.monotonic() - started:.0f} s")
