"""Launcher replicas on one real PostgreSQL 15 (launcher/leader.py), as real processes:
- the leader is killed with -9 while a job runs; the other replica takes the lease, adopts the
  running job (it finishes on its first attempt, each step once) and starts the queued ones in
  their order; the client, given both addresses, fails over; submissions taken by the
  follower are run by the leader, and a cancel sent to the follower is stored for the leader,
  which acts on it (launcher/replica_inbox.py): the job ends CANCELLED, queued or running;
- the leader is paused (SIGSTOP) past its lease: the other takes over; resumed, the former
  leader finds its lease taken and exits without acting, and the job still runs once.
Takeover times are printed, never asserted (they follow the machine's load); the soak
(launcher/bench/chaos_soak.py) measures them."""

import contextlib
import io
import os
import signal
import time

import psycopg
import pytest

from launcher import cli
from launcher.client import Client
from launcher.server import LOST_LEASE_EXIT
from launcher.testdata import harness as h
from launcher.testdata.postgres import running_postgres
from launcher.testdata.replicas import LEASE_SECONDS, leader, leading, replicas
from launcher.transitions import seconds
from protos import job_pb2

STEPS = 40


@pytest.fixture(scope="module")
def postgres_server():
    with running_postgres() as pg:
        yield pg


def ran_once(job: job_pb2.Job, steps: int):
    assert (job.state, job.attempts) == (job_pb2.SUCCEEDED, 1), job
    assert h.steps_log(job) == [(1, s) for s in range(1, steps + 1)]  # each step once


def test_the_leader_killed_the_other_replica_adopts_its_jobs(postgres_server, tmp_path):
    dsn = postgres_server.create_database("failover")
    a, b = replicas(tmp_path, dsn)
    h.behave(tmp_path, "long", steps=STEPS, step_seconds=0.15)
    with leading(dsn, a, b) as (epoch, client), contextlib.closing(Client(b.address)) as follower:
        long = client.submit(h.spec("long"))
        first = follower.submit(h.spec("first", steps=2))  # stored by the follower: one node,
        second = follower.submit(h.spec("second", steps=2))  # so they wait behind `long`
        h.wait_for_step(client, long.id, 3)
        assert client.get(first.id).state == job_pb2.QUEUED
        third = follower.submit(h.spec("third", steps=2))
        cancelled = follower.cancel(third.id)  # the follower stores it; a, leading, acts on it
        assert cancelled.state == job_pb2.CANCELLED, cancelled
        assert cancelled.exit_reason == "cancelled before it started"
        with psycopg.connect(dsn) as db:  # the request is gone once acted on
            assert db.execute("SELECT count(*) FROM cancel_requests").fetchone() == (0,)

        killed = time.monotonic()
        a.kill9()
        h.wait_until(lambda: leader(dsn) == (epoch + 1, b.address), "b takes over", timeout=60)
        print(
            f"takeover after kill -9: {time.monotonic() - killed:.2f} s (lease {LEASE_SECONDS} s)"
        )
        assert client.get(long.id).state == job_pb2.RUNNING  # a's address first: failed over
        out = io.StringIO()
        assert cli.main(["--launcher", f"{a.address},{b.address}", "status", long.id], out) == 0
        assert "RUNNING" in out.getvalue()
        watch = ["--launcher", f"{a.address},{b.address}", "watch", long.id]
        assert cli.main(watch, io.StringIO()) == 0  # the stream to a fails: followed on b

        ran_once(h.wait_for(client, long.id, h.FINAL, timeout=60), STEPS)
        # its trainer's stream moved to b, which leads now: b saw its last steps
        assert client.get(long.id).progress.step == STEPS
        done = [h.wait_for(client, j.id, h.FINAL, timeout=60) for j in (first, second)]
        for job in done:
            ran_once(job, 2)
        assert seconds(done[0].started) < seconds(done[1].started)  # queue order kept
        assert seconds(done[0].started) >= seconds(client.get(long.id).finished)
    assert f"{third.id}: cancelled as another replica was asked to" in a.log_path.read_text()
    log = b.log_path.read_text()
    assert f"took the lease as epoch {epoch + 1}" in log
    assert f"leader (epoch {epoch + 1}): 1 running and 2 queued jobs adopted" in log


def test_a_paused_leader_cannot_act_once_replaced(postgres_server, tmp_path):
    dsn = postgres_server.create_database("paused")
    a, b = replicas(tmp_path, dsn)
    h.behave(tmp_path, "long", steps=STEPS, step_seconds=0.15)
    with leading(dsn, a, b) as (epoch, client):
        long = client.submit(h.spec("long"))
        h.wait_for_step(client, long.id, 3)
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        paused = time.monotonic()
        h.wait_until(lambda: leader(dsn) == (epoch + 1, b.address), "b takes over", timeout=60)
        print(f"takeover from a paused leader: {time.monotonic() - paused:.2f} s")
        os.kill(a.proc.pid, signal.SIGCONT)
        assert a.proc.wait(30) == LOST_LEASE_EXIT
        ran_once(h.wait_for(client, long.id, h.FINAL, timeout=60), STEPS)
        assert leader(dsn) == (epoch + 1, b.address)
    assert "lost the leader lease" in a.log_path.read_text()


def test_a_running_job_cancelled_through_the_follower(postgres_server, tmp_path):
    dsn = postgres_server.create_database("cancel")
    a, b = replicas(tmp_path, dsn)
    h.behave(tmp_path, "long", steps=STEPS, step_seconds=0.15)
    with leading(dsn, a, b) as (_, client), contextlib.closing(Client(b.address)) as follower:
        long = client.submit(h.spec("long"))
        h.wait_for_step(client, long.id, 3)
        answered = follower.cancel(long.id)  # answered once the leader has acted on it
        assert answered.stop == job_pb2.STOP_CANCEL or answered.state == job_pb2.CANCELLED
        done = h.wait_for(client, long.id, h.FINAL, timeout=60)
        assert (done.state, done.attempts) == (job_pb2.CANCELLED, 1), done
        assert h.steps_log(done)[-1][1] < STEPS  # stopped mid-run
    assert f"{long.id}: cancelled as another replica was asked to" in a.log_path.read_text()
