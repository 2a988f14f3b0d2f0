"""`kitchen` against a live launcher, and the live view's formatting."""

import io

import pytest

from launcher import cli
from launcher.live_view import LiveView, duration, rate, row
from launcher.testdata import harness as h
from protos import job_pb2


@pytest.fixture
def launcher(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        yield launcher, client


def kitchen(launcher, *argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(["--launcher", launcher.address, *argv], out=out)
    return code, out.getvalue()


def test_list_status_logs_watch(launcher):
    server, client = launcher
    job = client.submit(h.spec("tiny", steps=3, team="nlp"))
    code, text = kitchen(server, "watch", job.id)
    assert code == 0
    assert f"{job.id} SUCCEEDED" in text and "final loss 3.333 at step 3" in text
    code, text = kitchen(server, "list")
    header, line = text.splitlines()
    assert header.split() == [n for n, _ in cli.LIST_COLUMNS]
    assert line.split()[:8] == [job.id, "tiny", "pretrain", "SUCCEEDED", "nlp", "cpu", "1", "3/3"]
    code, text = kitchen(server, "list", "--state", "running")
    assert text.splitlines()[1:] == []
    code, text = kitchen(server, "status", job.id)
    assert "state       SUCCEEDED" in text and "attempts    1 (0 failed, 0 preempted)" in text
    assert "MFU 25.0% (measured)" in text and f"run dir     {job.run_dir}" in text
    code, text = kitchen(server, "logs", job.id)
    assert "===== attempt 1 =====" in text and "done at step 3" in text


def test_cancel_and_errors(launcher, tmp_path, capsys):
    server, client = launcher
    h.behave(tmp_path, "long", steps=10_000, step_seconds=0.02)
    job = client.submit(h.spec("long"))
    h.wait_for_step(client, job.id, 1)
    code, text = kitchen(server, "cancel", job.id)
    assert code == 0 and "stopping (the trainer saves a checkpoint)" in text
    assert kitchen(server, "watch", job.id)[0] == 130  # the outcome of a cancelled job
    assert kitchen(server, "status", "j404")[0] == 1
    assert "NOT_FOUND: no job 'j404'" in capsys.readouterr().err


def test_formatting_has_units():
    assert [duration(s) for s in (4.2, 185, 3723)] == ["4 s", "3:05", "1:02:03"]
    assert [rate(r) for r in (950, 4100, 2.5e6)] == ["950 tok/s", "4.1k tok/s", "2.5M tok/s"]
    job = job_pb2.Job(state=job_pb2.RUNNING)
    job.progress.step, job.progress.total_steps, job.progress.loss = 50, 200, 3.41234
    job.progress.tokens_per_second, job.progress.mfu, job.progress.step_time_seconds = (
        4100,
        0.012,
        0.5,
    )
    assert row(job) == ["RUNNING", "50/200 (25%)", "3.412", "4.1k tok/s", "1.2%", "1:15"]


def test_live_view_tells_the_story_in_a_log_file():
    out = io.StringIO()
    now = [0.0]
    view = LiveView(out, interactive=False, clock=lambda: now[0])
    job = job_pb2.Job(
        id="j1",
        run_dir="/runs/j1",
        state=job_pb2.QUEUED,
        waiting_reason="pool cpu full (1/1 nodes in use)",
    )
    view.update(job)
    job.state, job.attempts, job.waiting_reason = job_pb2.RUNNING, 1, ""
    job.progress.step, job.progress.total_steps, job.progress.loss = 10, 100, 4.0
    view.update(job)
    job.progress.step = 20
    view.update(job)  # within 5 s of the last row: not printed
    now[0] = 6.0
    job.progress.message = "checkpoint saved at step 20"
    view.update(job)
    lines = [line.split("] ", 1)[-1] for line in out.getvalue().splitlines()]
    assert lines == [
        "j1 QUEUED",
        "waiting: pool cpu full (1/1 nodes in use)",
        "j1 RUNNING",
        "trainer output (precook, steps, errors): /runs/j1/attempts/001/output.log",
        "STATE     STEP             LOSS     THROUGHPUT    MFU     ETA",
        "RUNNING   10/100 (10%)     4.000    -             -       -",
        "checkpoint saved at step 20",
        "RUNNING   20/100 (20%)     4.000    -             -       -",
    ]
