"""A serve job under a real launcher running the real trainer: it stays RUNNING past its hang
timeout while healthy (its heartbeat is progress), `kitchen status` and the launcher's
/metrics show its endpoint and load, the openai client gets answers from the endpoint, and a
cancel ends it CANCELLED after it drains."""

import io
import sys
import time
import urllib.request

import openai

from launcher import cli
from launcher.testdata import harness
from protos import job_pb2
from protos.config_yaml import job_spec_from_dict
from trainer import testing

HANG_TIMEOUT = 45.0  # above a trainer's start-up on a loaded 2-core machine (15 s seen)


def test_serve_job_runs_until_cancelled_and_is_watched_like_training(tmp_path):
    cfg = harness.config(tmp_path)
    cfg.kill_grace_seconds = 60  # a drain takes its time
    cfg.ClearField("trainer_cmd")
    cfg.trainer_cmd.extend([sys.executable, "-m", "trainer.main"])
    train = testing.tiny_job(tmp_path / "cache", steps=4)
    with harness.started(cfg) as (launcher, client):
        trained = client.submit(job_spec_from_dict(train))
        trained = harness.wait_for(client, trained.id, harness.FINAL, timeout=300)
        assert trained.state == job_pb2.SUCCEEDED, trained.exit_reason
        serve = testing.tiny_job(tmp_path / "cache", kind="SERVE")
        serve["trainer"]["checkpoint"] = {"path": f"{trained.run_dir}/checkpoints/step_00000004"}
        serve["trainer"]["serve"] = {"heartbeat_seconds": 1.0, "model_name": "tiny"}
        serve["hang_timeout_seconds"] = HANG_TIMEOUT
        job = client.submit(job_spec_from_dict(serve))

        harness.wait_until(
            lambda: client.get(job.id).progress.endpoint, "the serve job's endpoint", timeout=300
        )
        endpoint = client.get(job.id).progress.endpoint
        api = openai.OpenAI(base_url=endpoint + "/v1", api_key="-", max_retries=0)
        got = api.completions.create(model="tiny", prompt="import ", max_tokens=8, temperature=0)
        assert got.choices[0].finish_reason in ("stop", "length")

        running_since = time.monotonic()
        while time.monotonic() - running_since < HANG_TIMEOUT + 5:  # past the hang timeout
            time.sleep(1.0)
        job = client.get(job.id)
        assert job.state == job_pb2.RUNNING and job.attempts == 1, job.exit_reason
        assert job.progress.requests_finished == 1 and job.progress.kv_blocks_free > 0

        out = io.StringIO()
        assert cli.main(["--launcher", launcher.address, "status", job.id], out=out) == 0
        assert f"serving     {endpoint}/v1: 0 running, 0 waiting" in out.getvalue()
        scrape = f"http://127.0.0.1:{launcher.metrics_port}/metrics"
        metrics = urllib.request.urlopen(scrape, timeout=10).read().decode()
        assert f'kitchen_serve_kv_blocks_free{{job_id="{job.id}"' in metrics

        client.cancel(job.id)
        job = harness.wait_for(client, job.id, harness.FINAL, timeout=120)
        assert job.state == job_pb2.CANCELLED, job.exit_reason
        output = tmp_path / "state" / "runs" / job.id / "attempts" / "001" / "output.log"
        assert "stopped (drained); 1 requests served" in output.read_text()
