"""The control loop against what one job or the store does to it. A real launcher runs the fake
trainer; faults are injected by replacing one function at a time.

- A failure while handling one job (at any step of starting, following, ending or cancelling
  it) stores that job FAILED with the reason; the other jobs run as if nothing happened, the
  state dir is sound for the next launcher, and the log gets a bounded number of lines.
- A failing store (a full disk) holds changes back with memory as it was; a cancel's caller
  sees the store's error; the loop neither spins nor floods the log, and catches up when the
  store works again.
"""

import logging
import math
import os
import sqlite3
import threading
import time

import grpc
import pytest

from launcher import scheduler, transitions
from launcher.executors import handoff
from launcher.executors.attempt_wrapper import start_ticks
from launcher.executors.base import attempt_dir, read_json
from launcher.store import JobStore
from launcher.testdata import harness as h
from protos import job_pb2

INJECTED = "injected fault"
DISK_FULL = "database or disk is full"


def raising_for(name: str, real):
    """`real`, but raising for the job named `name` (a Job, or a Launch/Queued/LiveAttempt or
    Demand of it, among the arguments)."""

    def faulty(*args, **kwargs):
        for arg in (*args, *kwargs.values()):
            job = getattr(arg, "job", arg)
            if isinstance(job, job_pb2.Job) and job.spec.name == name:
                raise RuntimeError(INJECTED)
            if isinstance(arg, list) and any(getattr(d, "team", "") == name for d in arg):
                raise RuntimeError(INJECTED)  # scheduler.plan's demands: the job's team
        return real(*args, **kwargs)

    return faulty


def launcher_records(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kitchen.launcher" and text in r.getMessage()]


# (what fails, how to make it fail given the launcher, the bad job's reason, cancel it?)
STEPS = {
    "computing its start": (
        lambda _, mp: mp.setattr(transitions, "started", raising_for("bad", transitions.started)),
        "launcher error while starting it: RuntimeError: injected fault",
    ),
    "writing its handoff": (
        lambda _, mp: mp.setattr(handoff, "write", raising_for("bad", handoff.write)),
        "lost: could not start: injected fault (failure 1 of 1)",
    ),
    "the executor's start": (
        lambda lc, mp: mp.setattr(
            lc.controller.attempts.executors["cpu"],
            "start",
            raising_for("bad", lc.controller.attempts.executors["cpu"].start),
        ),
        "lost: could not start: injected fault (failure 1 of 1)",
    ),  # fmt: skip
    "storing what the executor said": (
        lambda _, mp: mp.setattr(transitions, "launched", raising_for("bad", transitions.launched)),
        "launcher error while starting it: RuntimeError: injected fault",
    ),
    "recording its progress": (
        lambda _, mp: mp.setattr(
            transitions, "with_progress", raising_for("bad", transitions.with_progress)
        ),
        "launcher error while recording its progress: RuntimeError: injected fault",
    ),
    "judging its exit": (
        lambda _, mp: mp.setattr(scheduler, "after_exit", raising_for("bad", scheduler.after_exit)),
        "launcher error while following its attempt: RuntimeError: injected fault",
    ),
    "computing its end": (
        lambda _, mp: mp.setattr(transitions, "ended", raising_for("bad", transitions.ended)),
        "launcher error while following its attempt: RuntimeError: injected fault",
    ),
    "cancelling it": (
        lambda _, mp: mp.setattr(transitions, "stopping", raising_for("bad", transitions.stopping)),
        "launcher error while cancelling it: injected fault",
    ),
    "scheduling it": (
        lambda _, mp: mp.setattr(scheduler, "plan", raising_for("bad", scheduler.plan)),
        "launcher error while scheduling it: RuntimeError: injected fault",
    ),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_failure_in_one_job_fails_that_job_only(tmp_path, monkeypatch, caplog, step):
    caplog.set_level(logging.INFO, logger="kitchen.launcher")
    inject, reason = STEPS[step]
    cfg = h.config(tmp_path, nodes=2)
    with h.started(cfg) as (launcher, client):
        inject(launcher, monkeypatch)
        h.behave(tmp_path, "bad", steps=10_000 if step == "cancelling it" else 60)
        bad = h.spec("bad", team="bad")
        bad.retry.max_attempts = 1
        bad = client.submit(bad)
        good = [client.submit(h.spec(f"good{i}", steps=3)) for i in range(4)]
        if step == "cancelling it":
            h.wait_for_step(client, bad.id, 2)
            assert client.cancel(bad.id).state == job_pb2.FAILED
        done = h.wait_for(client, bad.id, h.FINAL, timeout=60)
        assert (done.state, done.exit_reason) == (job_pb2.FAILED, reason)
        for job in good:
            finished = h.wait_for(client, job.id, h.FINAL, timeout=60)
            assert (finished.state, finished.attempts) == (job_pb2.SUCCEEDED, 1), finished
        pids = read_json(os.path.join(attempt_dir(bad.run_dir, 1), "pid.json"))
        if pids is not None:  # it started: nothing of it may outlive its failure
            h.wait_until(lambda: start_ticks(pids["pid"]) is None, "the bad job's wrapper ended")
        lines = len(launcher_records(caplog, INJECTED))
        time.sleep(1.0)  # twenty more passes of the loop
        assert 1 <= lines == len(launcher_records(caplog, INJECTED)) <= 3
    monkeypatch.undo()
    with h.started(cfg) as (_, client):  # the state dir holds no half-changed job
        assert {j.state for j in client.list().jobs} <= set(h.FINAL)
        again = h.wait_for(client, client.submit(h.spec("after", steps=3)).id, h.FINAL)
        assert again.state == job_pb2.SUCCEEDED


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("backoff_seconds", math.nan, "ValueError: cannot convert float NaN to integer"),
        ("backoff_seconds", 1e12, "ValueError: Timestamp is not valid"),
    ],
)
def test_a_spec_that_breaks_the_arithmetic_fails_alone(tmp_path, field, value, reason):
    with h.started(h.config(tmp_path)) as (launcher, client):
        h.behave(tmp_path, "odd", steps=4, crash_at=1, crash_attempts=[1])
        spec = h.spec("odd")
        setattr(spec.retry, field, value)
        # Straight to the controller: it must hold up whatever passes validation.
        odd, _ = launcher.controller.submit(job_pb2.Job(spec=spec, pool="cpu"))
        good = client.submit(h.spec("good", steps=3))
        done = h.wait_for(client, odd.id, h.FINAL)
        assert done.state in (job_pb2.FAILED, job_pb2.SUCCEEDED) and not done.handle
        if done.state == job_pb2.FAILED:  # the retry's start time overflows a Timestamp
            assert done.exit_reason.startswith("launcher error while following its attempt: ")
            assert reason in done.exit_reason
        assert h.wait_for(client, good.id, h.FINAL).state == job_pb2.SUCCEEDED


def test_a_half_changed_row_from_an_older_launcher_fails_alone_at_recovery(tmp_path):
    cfg = h.config(tmp_path)
    store = JobStore(os.path.join(cfg.state_dir, "jobs.sqlite"))
    rows = []
    for name, state in (("half", job_pb2.RUNNING), ("queued", job_pb2.QUEUED)):
        job, _ = store.insert(job_pb2.Job(spec=h.spec(name, steps=3), pool="cpu", state=state))
        job.run_dir = os.path.join(cfg.state_dir, "runs", job.id)
        store.update(job)  # "half": RUNNING without a handle, as the old controller left it
        rows.append(job)
    store.close()
    with h.started(cfg) as (launcher, client):
        half = client.get(rows[0].id)
        assert half.state == job_pb2.FAILED
        assert half.exit_reason.startswith("launcher error while taking it up again: ")
        assert h.wait_for(client, rows[1].id, h.FINAL).state == job_pb2.SUCCEEDED


def test_a_kind_outside_the_enum_troubles_no_one(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        spec = h.spec("alien", steps=3)
        spec.kind = 99  # type: ignore[assignment]  # raw gRPC can send it; metrics cannot name it
        alien, _ = launcher.controller.submit(job_pb2.Job(spec=spec, pool="cpu"))
        good = client.submit(h.spec("good", steps=3))
        done = h.wait_for(client, alien.id, h.FINAL)
        assert (done.state, done.progress.step) == (job_pb2.SUCCEEDED, 3)
        log = open(os.path.join(attempt_dir(done.run_dir, 1), "output.log")).read()
        assert "progress stream failed" not in log  # its reports were taken, not refused
        assert h.wait_for(client, good.id, h.FINAL).state == job_pb2.SUCCEEDED


def test_a_failing_store_holds_changes_back_and_the_loop_catches_up(tmp_path, caplog):
    launcher, client = h.start(h.config(tmp_path, nodes=3))
    real, broken, calls = launcher.store.update, threading.Event(), []

    def update(job, attempt_token=None):
        if broken.is_set():
            calls.append(job.id)
            raise sqlite3.OperationalError(DISK_FULL)
        return real(job, attempt_token=attempt_token)

    launcher.store.update = update  # type: ignore[method-assign]
    try:
        h.behave(tmp_path, "ending", steps=12, step_seconds=0.05)
        ending = client.submit(h.spec("ending"))
        h.wait_for_step(client, ending.id, 2)
        broken.set()  # the disk is full: submitting still works (SQLite had room for that)
        waiting = [client.submit(h.spec(f"waiting{i}", steps=3)) for i in range(2)]
        exit_json = os.path.join(attempt_dir(ending.run_dir, 1), "exit.json")
        h.wait_until(lambda: os.path.exists(exit_json), "the running job's trainer ended")
        h.wait_until(
            lambda: "could not store its start" in client.get(waiting[0].id).waiting_reason,
            "the waiting job says why",
        )
        with pytest.raises(grpc.RpcError) as refused:
            client.cancel(waiting[1].id)
        assert DISK_FULL in refused.value.details()  # the store's error, as it is
        time.sleep(1.5)  # thirty passes of the loop with every write failing
        assert len(launcher_records(caplog, DISK_FULL)) == 1
        assert len(calls) < 20  # held back with a doubling delay, not tried every pass
        # Memory is as stored: the ended job still runs, the others still wait.
        assert client.get(ending.id).state == job_pb2.RUNNING
        assert {client.get(j.id).state for j in waiting} == {job_pb2.QUEUED}

        broken.clear()  # space is freed
        for job in (ending, *waiting):
            done = h.wait_for(client, job.id, h.FINAL, timeout=60)
            assert (done.state, done.attempts) == (job_pb2.SUCCEEDED, 1), done
        assert h.steps_log(client.get(ending.id)) == [(1, s) for s in range(1, 13)]
        assert len(launcher_records(caplog, "store write works again")) == 1
    finally:
        client.close()
        launcher.stop()


def test_a_pass_that_fails_as_a_whole_is_retried_without_spinning(tmp_path, caplog, monkeypatch):
    calls = []

    def plan(*args):
        calls.append(1)
        raise RuntimeError(INJECTED)

    monkeypatch.setattr(scheduler, "plan", plan)
    with h.started(h.config(tmp_path)) as (launcher, client):
        time.sleep(1.5)  # thirty polls' worth
        assert 1 <= len(calls) < 10  # each failed pass waits twice as long as the last
        assert len(launcher_records(caplog, INJECTED)) == 1
        monkeypatch.undo()
        job = h.wait_for(client, client.submit(h.spec("later", steps=3)).id, h.FINAL)
        assert job.state == job_pb2.SUCCEEDED
        assert len(launcher_records(caplog, "control loop works again")) == 1
