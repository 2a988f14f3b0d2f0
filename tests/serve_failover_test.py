"""A serve job under two launcher replicas on one real PostgreSQL (launcher/leader.py), the
real trainer serving a tiny checkpoint: the leader is killed with -9 while a client keeps
asking the endpoint for completions. The endpoint stays up (every request through the failover
is answered: the trainer does not depend on the launcher that started it), the other replica
takes the lease and adopts the same attempt (the same trainer process, attempt 1, not
restarted; its heartbeats reach the new leader, so it is not taken for hung), and a cancel
through the new leader drains and stops it. The failover time and the number of requests are
printed, never asserted; the count of failed requests is asserted: 0."""

import contextlib
import os
import sys
import threading
import time

import openai
import pytest

from launcher.executors.attempt_wrapper import start_ticks
from launcher.executors.base import attempt_dir
from launcher.testdata import harness as h
from launcher.testdata.postgres import running_postgres
from launcher.testdata.replicas import LEASE_SECONDS, leader, leading, replicas
from protos import job_pb2
from protos.config_yaml import job_spec_from_dict
from trainer import testing

HANG_TIMEOUT = 45.0  # above a trainer's start-up on a loaded 2-core machine (15 s seen)
AFTER_TAKEOVER_SECONDS = 10.0  # requests kept going after the new leader took over


class Poller(threading.Thread):
    """Asks the endpoint for a completion, again and again, counting answers and failures."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.api = openai.OpenAI(base_url=endpoint + "/v1", api_key="-", max_retries=0)
        self.done = threading.Event()
        self.ok = 0
        self.failed: list[str] = []

    def run(self):
        while not self.done.is_set():
            try:
                got = self.api.completions.create(
                    model="tiny", prompt="import ", max_tokens=2, temperature=0, timeout=30
                )
                assert got.choices[0].finish_reason in ("stop", "length"), got
                self.ok += 1
            except Exception as e:  # counted, and shown if any
                self.failed.append(f"{type(e).__name__}: {e}")
            time.sleep(0.05)


def trainer_process(job: job_pb2.Job) -> tuple[int, int]:
    """(pid, start ticks) of the attempt's trainer, as its wrapper recorded them."""
    pids = h.written_json(os.path.join(attempt_dir(job.run_dir, job.attempts), "pid.json"))
    return pids["child_pgid"], pids["child_start_ticks"]


@pytest.fixture(autouse=True)
def absolute_pythonpath(monkeypatch):
    """Replicas run the trainer from the job's run dir: imports must not depend on it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(os.path.abspath(p) for p in sys.path))


def test_serve_endpoint_stays_up_through_a_leader_killed(tmp_path):
    cfg = h.config(tmp_path, nodes=1)
    cfg.kill_grace_seconds = 60  # a drain takes its time
    cfg.ClearField("trainer_cmd")
    cfg.trainer_cmd.extend([sys.executable, "-m", "trainer.main"])
    train = testing.tiny_job(tmp_path / "cache", steps=4)
    with running_postgres() as pg:
        dsn = pg.create_database("serve")
        a, b = replicas(tmp_path, dsn, cfg=cfg)
        with leading(dsn, a, b) as (epoch, client), contextlib.ExitStack() as cleanup:
            trained = client.submit(job_spec_from_dict(train))
            trained = h.wait_for(client, trained.id, h.FINAL, timeout=300)
            assert trained.state == job_pb2.SUCCEEDED, trained.exit_reason
            serve = testing.tiny_job(tmp_path / "cache", kind="SERVE")
            checkpoint = f"{trained.run_dir}/checkpoints/step_00000004"
            serve["trainer"]["checkpoint"] = {"path": checkpoint}
            serve["trainer"]["serve"] = {"heartbeat_seconds": 1.0, "model_name": "tiny"}
            serve["hang_timeout_seconds"] = HANG_TIMEOUT
            job = client.submit(job_spec_from_dict(serve))
            h.wait_until(lambda: client.get(job.id).progress.endpoint, "the endpoint", 300)
            job = client.get(job.id)
            before = trainer_process(job)
            poller = Poller(job.progress.endpoint)
            poller.start()
            cleanup.callback(poller.done.set)
            h.wait_until(lambda: poller.ok >= 3, "three answers before the kill", timeout=60)

            killed = time.monotonic()
            a.kill9()
            h.wait_until(lambda: leader(dsn) == (epoch + 1, b.address), "b takes over", 60)
            took = time.monotonic() - killed
            answered = poller.ok
            time.sleep(AFTER_TAKEOVER_SECONDS)
            # the trainer's heartbeats reach b now: b's view of the job moves on
            seen = client.get(job.id).progress.requests_finished
            h.wait_until(
                lambda: client.get(job.id).progress.requests_finished > seen,
                "the new leader hears the trainer's heartbeats", timeout=30,
            )  # fmt: skip
            poller.done.set()
            poller.join(60)
            print(
                f"serve failover: takeover {took:.2f} s after kill -9 (lease {LEASE_SECONDS} s); "
                f"{poller.ok} requests answered ({poller.ok - answered} after the takeover), "
                f"{len(poller.failed)} failed"
            )
            assert poller.failed == [], poller.failed[:5]
            assert poller.ok > answered  # it served on after the takeover, too

            adopted = client.get(job.id)
            assert (adopted.state, adopted.attempts) == (job_pb2.RUNNING, 1), adopted
            assert trainer_process(adopted) == before  # the same process, not restarted
            assert start_ticks(before[0]) == before[1]  # and still alive

            client.cancel(job.id)  # a's address first: failed over to b, which leads
            done = h.wait_for(client, job.id, h.FINAL, timeout=120)
            assert done.state == job_pb2.CANCELLED, done.exit_reason
            output = attempt_dir(done.run_dir, 1) + "/output.log"
            assert "stopped (drained)" in open(output).read()
    log = b.log_path.read_text()
    assert f"took the lease as epoch {epoch + 1}" in log
    assert f"leader (epoch {epoch + 1}): 1 running and 0 queued jobs adopted" in log
