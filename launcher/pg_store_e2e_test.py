"""A real launcher process on the PostgreSQL store (a real PostgreSQL 15 on 127.0.0.1): it runs
jobs with the fake trainer, is killed with -9, and a second launcher on the same database
adopts the running job and finishes the queued one. The database password never shows in the
launchers' logs, their errors, or the trainer's command line and environment. A full database
disk holds the launcher's changes back with PostgreSQL's own error; it catches up after."""

import os

import psycopg
import pytest

from launcher import server
from launcher.testdata import harness as h
from launcher.testdata.postgres import running_postgres
from protos import job_pb2, launcher_pb2


@pytest.fixture(scope="module")
def postgres_server():
    with running_postgres() as pg:
        yield pg


def store_config(**where) -> launcher_pb2.StoreConfig:
    return launcher_pb2.StoreConfig(postgres=launcher_pb2.PostgresStore(**where))


def dsn_file(path, dsn: str) -> str:
    path.write_text(dsn + "\n")
    path.chmod(0o600)
    return str(path)


def test_a_launcher_on_postgres_is_killed_and_the_next_one_adopts_its_jobs(
    postgres_server, tmp_path
):
    dsn = postgres_server.create_database("kitchen")
    secret = postgres_server.password
    cfg = h.config(tmp_path, nodes=1, store=store_config(dsn_env="KITCHEN_PG_DSN"))
    h.behave(tmp_path, "long", steps=20, step_seconds=0.1)
    first = h.LauncherProcess(tmp_path, cfg, env={"KITCHEN_PG_DSN": dsn})
    second = None
    client = first.start()
    try:
        long = client.submit(h.spec("long"))
        queued = client.submit(h.spec("queued", steps=3))  # one node: waits for `long`
        h.wait_for_step(client, long.id, 3)
        assert first.proc is not None
        trainers = [p for p in h.process_tree(first.proc.pid) if p != first.proc.pid]
        assert trainers and h.where_it_shows(secret, trainers) == []  # jobs get no password
        assert h.where_it_shows(secret, [first.proc.pid]) == [f"{first.proc.pid} environ"]
        first.kill9()
        client.close()

        # The next launcher reads the string from a file: nothing on the command line either.
        cfg.store.CopyFrom(store_config(dsn_file=dsn_file(tmp_path / "dsn", dsn)))
        second = h.LauncherProcess(tmp_path, cfg)
        client = second.start()
        assert second.proc is not None and h.where_it_shows(secret, [second.proc.pid]) == []
        done = h.wait_for(client, long.id, h.FINAL, timeout=60)
        assert (done.state, done.attempts) == (job_pb2.SUCCEEDED, 1), done  # adopted
        steps = h.steps_log(done)
        assert steps == [(1, s) for s in range(1, 21)]  # each step once, one attempt
        after = h.wait_for(client, queued.id, h.FINAL, timeout=60)
        assert (after.state, after.attempts) == (job_pb2.SUCCEEDED, 1), after
        new = client.submit(h.spec("new", steps=1))
        assert new.id == "j3"  # ids continue on the database's sequence
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None:
                proc.stop()
    with psycopg.connect(dsn) as db:
        rows = db.execute("SELECT seq, state FROM jobs ORDER BY seq").fetchall()
    assert [seq for seq, _ in rows] == [1, 2, 3]
    assert not os.path.exists(os.path.join(cfg.state_dir, "jobs.sqlite"))  # no SQLite aside
    log = (tmp_path / "launcher.log").read_text()
    assert "jobs in postgresql://kitchen@127.0.0.1" in log and secret not in log


def test_a_wrong_password_stops_the_launcher_with_a_message_without_it(
    postgres_server, tmp_path, capsys, caplog
):
    secret = "wrong-" + postgres_server.password
    wrong = dsn_file(tmp_path / "dsn", postgres_server.dsn("postgres", password=secret))
    cfg = h.config(tmp_path, store=store_config(dsn_file=wrong))
    config = tmp_path / "launcher.yaml"
    config.write_text(f"store: {{postgres: {{dsn_file: {wrong}}}}}\n")
    args = ["--config", str(config), "--state-dir", cfg.state_dir, "--listen", "127.0.0.1:0",
            "--metrics-listen", "none"]  # fmt: skip
    assert server.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"launcher: postgresql://kitchen@127.0.0.1:{postgres_server.port}/postgres: cannot open "
        "the job database: connection failed: "
    )
    assert "password authentication failed" in err
    assert secret not in err and secret not in caplog.text


# The database's disk cannot be filled here (it would take a filesystem of its own): a trigger
# raises PostgreSQL's own disk_full error for every change to a stored job, as the server
# would; a new job's row still fits (its insert writes the job into an empty row).
DISK_FULL = (
    "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "RAISE EXCEPTION 'could not extend file: No space left on device' "
    "USING ERRCODE = 'disk_full'; END $$",
    "CREATE TRIGGER disk_full BEFORE UPDATE ON jobs FOR EACH ROW "
    "WHEN (length(OLD.job) > 0) EXECUTE FUNCTION disk_full()",
)


def test_a_full_database_disk_holds_changes_back_and_the_launcher_catches_up(
    postgres_server, tmp_path, monkeypatch, caplog
):
    dsn = postgres_server.create_database("full")
    monkeypatch.setenv("KITCHEN_PG_DSN", dsn)
    cfg = h.config(tmp_path, store=store_config(dsn_env="KITCHEN_PG_DSN"))
    with h.started(cfg) as (_, client), psycopg.connect(dsn, autocommit=True) as db:
        for statement in DISK_FULL:
            db.execute(statement)
        job = client.submit(h.spec("waits", steps=3))
        h.wait_until(
            lambda: "No space left on device" in client.get(job.id).waiting_reason,
            "the job says why it waits",
        )
        assert client.get(job.id).waiting_reason.startswith(
            "the launcher could not store its start (DiskFull: could not extend file: No space "
            "left on device"
        )  # PostgreSQL's own error, as it is
        assert client.get(job.id).state == job_pb2.QUEUED
        db.execute("DROP TRIGGER disk_full ON jobs")  # room again
        done = h.wait_for(client, job.id, h.FINAL, timeout=60)
        assert (done.state, done.attempts) == (job_pb2.SUCCEEDED, 1), done
    logged = [r for r in caplog.records if "No space left on device" in r.getMessage()]
    assert len(logged) == 1  # once, however many passes found the disk full
