"""The job store on both backends, on real files and a real PostgreSQL 15 (started once for
this module, launcher/testdata/postgres.py): ids, run dirs, idempotency keys, pages, a failed
write, and refusing a database that is lost, foreign, newer or not a job store."""

import os
import re
import shutil
import sqlite3
import stat
import threading

import psycopg
import pytest

from launcher import pg_store
from launcher.pg_store import PostgresStore
from launcher.store import JobStore
from launcher.store_base import PageTokenError, RequestIdReused, StoreError
from launcher.testdata.postgres import running_postgres
from launcher.testdata.store_backends import Postgres, Sqlite
from protos import job_pb2


def new_job(name="tiny", team="nlp", state=job_pb2.QUEUED, pool="cpu", owner="alice"):
    job = job_pb2.Job(state=state, pool=pool)
    job.spec.name, job.spec.team, job.spec.owner = name, team, owner
    return job


@pytest.fixture(scope="module")
def postgres_server():
    with running_postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        return Sqlite(tmp_path)
    return Postgres(tmp_path, request.getfixturevalue("postgres_server"))


def fill(backend, n, where="") -> list[job_pb2.Job]:
    store = backend.open(where)
    jobs = [store.insert(new_job(name=f"n{i}"))[0] for i in range(n)]
    store.close()
    return jobs


def test_insert_get_update_survive_reopening(backend, tmp_path):
    store = backend.open()
    seen = []
    job, created = store.insert(new_job(), on_id=lambda j: seen.append((j.id, j.run_dir)))
    run_dir = str(tmp_path / "runs" / "j1")
    assert created and job.id == "j1" and job.run_dir == run_dir and os.path.isdir(run_dir)
    assert seen == [("j1", run_dir)]  # on_id sees the id and the run dir
    job.state = job_pb2.RUNNING
    store.update(job, attempt_token="tok")
    store.close()
    again = backend.open()
    stored = again.get("j1")
    assert stored is not None
    assert stored.state == job_pb2.RUNNING
    assert stored.run_dir == run_dir
    assert again.attempt_token_matches("j1", "tok")
    assert again.attempt_token_known("tok") and not again.attempt_token_known("tok2")
    assert not again.attempt_token_matches("j1", "tok2")
    assert not again.attempt_token_matches("j1", "")
    # the database keeps the token's hash only: a copy of it forges no progress
    ((kept,),) = backend.sql("SELECT attempt_token FROM jobs")
    assert kept.startswith("sha256:") and "tok" not in kept.removeprefix("sha256:")
    if backend.name == "sqlite":
        assert stat.S_IMODE(os.stat(backend.path()).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    assert again.get("j9") is None and again.get("nonsense") is None
    assert again.team_of("j1") == "nlp" and again.team_of("j9") is None
    again.close()


def test_request_id_returns_the_first_job_for_the_same_caller_and_spec(backend):
    store = backend.open()
    first, created = store.insert(new_job(), request_id="r-1")
    second, created_again = store.insert(new_job(), request_id="r-1")
    assert created and not created_again
    assert second == first
    assert store.page()[0] == [first]


def test_request_id_with_another_spec_is_an_error(backend):
    store = backend.open()
    first, _ = store.insert(new_job(), request_id="r-1")
    with pytest.raises(RequestIdReused, match="request_id: 'r-1' was used for job j1 with a diff"):
        store.insert(new_job(name="other"), request_id="r-1")
    assert store.page()[0] == [first]


def test_request_ids_of_other_teams_and_owners_do_not_cross(backend):
    store = backend.open()
    mine, _ = store.insert(new_job(name="mine", team="nlp"), request_id="nightly")
    theirs, created = store.insert(new_job(name="theirs", team="vision"), request_id="nightly")
    colleague, also = store.insert(new_job(name="bobs", owner="bob"), request_id="nightly")
    assert created and also
    assert (theirs.spec.name, colleague.spec.name) == ("theirs", "bobs")
    assert len({mine.id, theirs.id, colleague.id, mine.run_dir, theirs.run_dir}) == 5


def test_pages_newest_first_with_filters(backend):
    store = backend.open()
    for i in range(25):
        state = job_pb2.SUCCEEDED if i % 5 == 0 else job_pb2.QUEUED
        store.insert(new_job(name=f"n{i}", team="nlp" if i % 2 else "vision", state=state))
    ids, token = [], ""
    while True:
        jobs, token = store.page(page_size=10, page_token=token)
        ids += [j.id for j in jobs]
        if not token:
            break
    assert ids == [f"j{i}" for i in range(25, 0, -1)]
    done, _ = store.page(states=[job_pb2.SUCCEEDED])
    assert [j.id for j in done] == ["j21", "j16", "j11", "j6", "j1"]
    nlp_done, _ = store.page(states=[job_pb2.SUCCEEDED], team="nlp")
    assert [j.spec.name for j in nlp_done] == ["n15", "n5"]
    assert len(store.unfinished()) == 20
    assert store.counts() == {(job_pb2.SUCCEEDED, "cpu"): 5, (job_pb2.QUEUED, "cpu"): 20}
    for garbage in ("garbage", "YmVmb3JlOjk5OTk5OTk5OTk5OTk5OTk5OTk5OTk5"):  # before:99..9
        with pytest.raises(PageTokenError, match="page_token"):
            store.page(page_token=garbage)


def test_concurrent_writers_lose_nothing(backend, tmp_path):
    store = backend.open()
    errors = []

    def submit(worker):
        try:
            for i in range(25):
                store.insert(new_job(name=f"w{worker}-{i}"), request_id=f"{worker}-{i}")
        except Exception as e:  # collected: a failure in a thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=submit, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    jobs, _ = store.page(page_size=1000)
    assert len({j.id for j in jobs}) == len({j.spec.name for j in jobs}) == 200
    assert len(os.listdir(tmp_path / "runs")) == 200 + 1  # and store.json


def test_threads_racing_one_request_id_get_one_job(backend):
    """A client's retries arriving at once, on as many threads (and, on PostgreSQL, as many
    connections of the store's pool)."""
    store = backend.open()
    results, errors = [], []
    barrier = threading.Barrier(8)

    def submit():
        try:
            barrier.wait()
            results.append(store.insert(new_job(name="once"), request_id="retry-me"))
        except Exception as e:  # collected: a failure in a thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {job.id for job, _ in results} == {"j1"}
    assert sum(created for _, created in results) == 1
    assert [j.id for j in store.page()[0]] == ["j1"]
    store.close()


def test_a_lost_database_with_runs_present_is_refused(backend, tmp_path):
    fill(backend, 3)
    if backend.name == "sqlite":
        backend.path().unlink()
        lost = "missing"
    else:
        backend.server.drop_database(backend.database(""))
        lost = "cannot open the job database: .*does not exist"
    with pytest.raises(StoreError, match=lost):
        backend.open()
    if backend.name == "sqlite":
        assert not backend.path().exists()  # refused before SQLite made a new one


def test_the_lost_sqlite_database_message_in_full(tmp_path):
    path = tmp_path / "jobs.sqlite"
    fill(Sqlite(tmp_path), 3)
    path.unlink()
    with pytest.raises(StoreError) as err:
        JobStore(str(path))
    assert str(err.value) == (
        f"{path}: missing, but {tmp_path / 'runs'} holds 3 job directories (j3 is the newest): "
        f"refusing to reuse their ids; restore the database or move {tmp_path / 'runs'} away"
    )


def test_emptied_database_with_runs_present_is_refused(backend, tmp_path):
    fill(backend, 12)
    backend.empty()
    name = backend.db_name()
    with pytest.raises(StoreError) as err:
        backend.open()
    assert str(err.value).startswith(f"{name}: empty, but {tmp_path / 'runs'} holds 12 job dir")
    shutil.move(tmp_path / "runs", tmp_path / "runs.old")  # what the message suggests
    assert backend.open().insert(new_job())[0].id == "j1"


def test_another_stores_database_is_refused(backend, tmp_path):
    fill(backend, 2, "a")
    fill(backend, 5, "b")
    backend.copy("a", "b")
    with pytest.raises(StoreError, match=r"b/runs/store.json gives .*b/runs \(5 job directories"):
        backend.open("b")


def test_ids_are_never_reused_after_restoring_an_older_backup(backend, tmp_path, caplog):
    fill(backend, 2)
    backend.copy("", "backup")
    fill(backend, 3)  # j3..j5, then the database is lost and the backup comes back
    backend.copy("backup", "")
    (tmp_path / "runs" / "j5" / "exit.json").write_text('{"exit_code": 0}')
    caplog.clear()
    store = backend.open()
    assert [m for m in caplog.messages if "newest id" in m] == [
        f"{backend.db_name()}: its newest id is j2, but {tmp_path / 'runs' / 'j5'} exists "
        "(restored from a backup?): new ids start at j6"
    ]  # raised once on opening, not found one directory at a time
    job, _ = store.insert(new_job())
    assert job.id == "j6" and os.listdir(job.run_dir) == []
    assert (tmp_path / "runs" / "j5" / "exit.json").exists()  # the old job's files are its own
    store.close()


def test_a_run_dir_made_behind_the_stores_back_is_skipped(backend, tmp_path):
    store = backend.open()
    store.insert(new_job())
    os.mkdir(tmp_path / "runs" / "j2")
    job, _ = store.insert(new_job())
    assert job.id == "j3" and store.get("j2") is None
    assert store.insert(new_job())[0].id == "j4"


def test_a_newer_database_is_refused(backend):
    fill(backend, 1)
    backend.set_version(99)
    with pytest.raises(StoreError) as err:
        backend.open()
    assert str(err.value) == (
        f"{backend.db_name()}: schema version 99 is newer than this launcher's "
        f"({backend.version}): run the launcher that wrote it, or a newer one"
    )
    if backend.name == "postgres":  # a row anyone could edit: garbage is named, not a crash
        backend.set_version("seven")
        with pytest.raises(StoreError, match="schema_version 'seven' in table meta: not a num"):
            backend.open()


def test_a_database_that_is_not_a_job_store_is_refused(backend):
    backend.sql("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    kind = "SQLite" if backend.name == "sqlite" else "PostgreSQL"
    with pytest.raises(StoreError, match=rf"{backend.db_name()}: a {kind} database, but not a"):
        backend.open()
    assert backend.sql("SELECT count(*) FROM invoices") == [(0,)]  # and nothing was created


def test_a_corrupt_sqlite_file_is_a_clear_error(tmp_path):
    path = tmp_path / "jobs.sqlite"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match=r"jobs.sqlite: not a usable job database \(file is not"):
        JobStore(str(path))


def test_a_failed_write_surfaces_as_it_is_and_the_store_recovers(backend, tmp_path):
    store = backend.open()
    store.insert(new_job())
    backend.fill_disk(store)
    big = new_job(name="big")
    big.exit_reason = "x" * 200_000
    error, message = backend.disk_full
    with pytest.raises(error, match=message):
        store.insert(big)
    assert not os.path.exists(tmp_path / "runs" / "j2")  # the failed insert took its dir back
    backend.free_disk(store)  # the disk has room again
    job, created = store.insert(big)
    # PostgreSQL's sequence never goes back: the failed insert's id is skipped, not reused.
    assert created and job.id == ("j2" if backend.name == "sqlite" else "j3")
    stored = store.get(job.id)
    assert stored is not None and stored.exit_reason == big.exit_reason
    store.close()


def test_a_postgres_store_reconnects_after_losing_its_connections(postgres_server, tmp_path):
    """The server restarted or dropped the launcher's sessions: the call that finds its
    connection broken fails with the server's error, the next ones work."""
    backend = Postgres(tmp_path, postgres_server)
    store = backend.open()
    store.insert(new_job())
    backend.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid != pg_backend_pid()"
    )
    with pytest.raises(psycopg.OperationalError):
        store.get("j1")
    assert store.get("j1") is not None
    assert store.insert(new_job())[0].id == "j2"
    store.close()


def test_one_launcher_per_postgres_database(postgres_server, tmp_path, monkeypatch):
    """Two launchers (two state dirs) on one database would both run its jobs: the second
    store is refused while the first is open, naming the session that holds it."""
    monkeypatch.setattr(pg_store, "LOCK_WAIT_SECONDS", 0.5)
    backend = Postgres(tmp_path, postgres_server)
    first = backend.open("a")
    dsn = postgres_server.dsn(backend.database("a"))
    with pytest.raises(StoreError) as err:
        PostgresStore(dsn, str(tmp_path / "b"))
    assert re.fullmatch(
        rf"{re.escape(backend.db_name('a'))}: in use by another launcher \(its session: from "
        r"127\.0\.0\.1 \(server pid \d+\), connected 20\d\d-.*\): one launcher per database; "
        "stop that one, or give this one a database of its own",
        str(err.value),
    ), err.value
    first.close()
    second = PostgresStore(dsn, str(tmp_path / "b"))  # taken over once the first let go
    assert second.insert(new_job())[0].id == "j1"
    second.close()


def test_postgres_errors_never_show_the_password(postgres_server, tmp_path):
    secret = postgres_server.password
    with pytest.raises(StoreError) as err:
        PostgresStore(postgres_server.dsn("postgres", password="wrong-" + secret), str(tmp_path))
    assert "password authentication failed" in str(err.value) and secret not in str(err.value)
    assert str(err.value).startswith(
        f"postgresql://kitchen@127.0.0.1:{postgres_server.port}/postgres: cannot open"
    )
    with pytest.raises(StoreError, match="not a libpq connection string") as err:
        PostgresStore(f"host=127.0.0.1 password={secret} dbname", str(tmp_path))
    assert secret not in str(err.value)


V1_SCHEMA = """
CREATE TABLE jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, state INTEGER NOT NULL, team TEXT NOT NULL,
  owner TEXT NOT NULL, pool TEXT NOT NULL, request_id TEXT UNIQUE,
  attempt_token TEXT NOT NULL DEFAULT '', job BLOB NOT NULL
);
CREATE INDEX jobs_state ON jobs (state, seq);
CREATE INDEX jobs_team ON jobs (team, seq);
"""


def test_a_version_1_sqlite_database_is_migrated(tmp_path):
    path = tmp_path / "jobs.sqlite"
    with sqlite3.connect(path) as db:  # what the launcher wrote before schema version 2
        db.executescript(V1_SCHEMA)
        for seq, request_id in ((1, "r-1"), (2, None)):
            job = new_job(name=f"old{seq}")
            job.id, job.run_dir = f"j{seq}", str(tmp_path / "runs" / f"j{seq}")
            db.execute(
                "INSERT INTO jobs (seq, state, team, owner, pool, request_id, job) "
                "VALUES (?, ?, 'nlp', 'alice', 'cpu', ?, ?)",
                (seq, job.state, request_id, job.SerializeToString()),
            )
            os.makedirs(job.run_dir)
    db.close()
    store = JobStore(str(path))
    again, created = store.insert(new_job(name="old1"), request_id="r-1")
    assert not created and again.id == "j1"
    with pytest.raises(RequestIdReused):
        store.insert(new_job(name="changed"), request_id="r-1")
    fresh, _ = store.insert(new_job(name="new"), request_id="r-2")
    assert fresh.id == "j3" and [j.id for j in store.page()[0]] == ["j3", "j2", "j1"]
    store.close()
    assert JobStore(str(path)).store_id == store.store_id  # migrated once, then opened as is
