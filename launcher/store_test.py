"""The SQLite job store, on real files: ids, run dirs, idempotency keys, and refusing to open a
database that does not belong to the run directories beside it."""

import os
import shutil
import sqlite3
import stat
import threading

import pytest

from launcher.store import JobStore
from launcher.store_base import PageTokenError, RequestIdReused, StoreError
from protos import job_pb2


def new_job(name="tiny", team="nlp", state=job_pb2.QUEUED, pool="cpu", owner="alice"):
    job = job_pb2.Job(state=state, pool=pool)
    job.spec.name, job.spec.team, job.spec.owner = name, team, owner
    return job


def fill(path, n) -> list[job_pb2.Job]:
    store = JobStore(str(path))
    jobs = [store.insert(new_job(name=f"n{i}"))[0] for i in range(n)]
    store.close()
    return jobs


def test_insert_get_update_survive_reopening(tmp_path):
    path = str(tmp_path / "jobs.sqlite")
    store = JobStore(path)
    seen = []
    job, created = store.insert(new_job(), on_id=lambda j: seen.append((j.id, j.run_dir)))
    run_dir = str(tmp_path / "runs" / "j1")
    assert created and job.id == "j1" and job.run_dir == run_dir and os.path.isdir(run_dir)
    assert seen == [("j1", run_dir)]  # on_id sees the id and the run dir
    job.state = job_pb2.RUNNING
    store.update(job, attempt_token="tok")
    store.close()
    again = JobStore(path)
    stored = again.get("j1")
    assert stored is not None
    assert stored.state == job_pb2.RUNNING
    assert stored.run_dir == run_dir
    assert again.attempt_token_matches("j1", "tok")
    assert not again.attempt_token_matches("j1", "tok2")
    assert not again.attempt_token_matches("j1", "")
    # the database keeps the token's hash only: a copy of it forges no progress
    with sqlite3.connect(path) as db:
        (kept,) = db.execute("SELECT attempt_token FROM jobs").fetchone()
    assert kept.startswith("sha256:") and "tok" not in kept.removeprefix("sha256:")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    assert again.get("j9") is None and again.get("nonsense") is None


def test_request_id_returns_the_first_job_for_the_same_caller_and_spec(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    first, created = store.insert(new_job(), request_id="r-1")
    second, created_again = store.insert(new_job(), request_id="r-1")
    assert created and not created_again
    assert second == first
    assert store.page()[0] == [first]


def test_request_id_with_another_spec_is_an_error(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    first, _ = store.insert(new_job(), request_id="r-1")
    with pytest.raises(RequestIdReused, match="request_id: 'r-1' was used for job j1 with a diff"):
        store.insert(new_job(name="other"), request_id="r-1")
    assert store.page()[0] == [first]


def test_request_ids_of_other_teams_and_owners_do_not_cross(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    mine, _ = store.insert(new_job(name="mine", team="nlp"), request_id="nightly")
    theirs, created = store.insert(new_job(name="theirs", team="vision"), request_id="nightly")
    colleague, also = store.insert(new_job(name="bobs", owner="bob"), request_id="nightly")
    assert created and also
    assert (theirs.spec.name, colleague.spec.name) == ("theirs", "bobs")
    assert len({mine.id, theirs.id, colleague.id, mine.run_dir, theirs.run_dir}) == 5


def test_pages_newest_first_with_filters(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
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
    with pytest.raises(PageTokenError, match="page_token"):
        store.page(page_token="garbage")


def test_concurrent_writers_lose_nothing(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
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


def test_deleted_database_with_runs_present_is_refused(tmp_path):
    path = tmp_path / "jobs.sqlite"
    fill(path, 3)
    path.unlink()
    with pytest.raises(StoreError) as err:
        JobStore(str(path))
    assert str(err.value) == (
        f"{path}: missing, but {tmp_path / 'runs'} holds 3 job directories (j3 is the newest): "
        f"refusing to reuse their ids; restore the database or move {tmp_path / 'runs'} away"
    )
    assert not path.exists()  # refused before SQLite made a new one


def test_emptied_database_with_runs_present_is_refused(tmp_path):
    path = tmp_path / "jobs.sqlite"
    fill(path, 12)
    path.write_bytes(b"")
    with pytest.raises(StoreError, match=r"jobs.sqlite: empty, but .* holds 12 job directories"):
        JobStore(str(path))
    shutil.move(tmp_path / "runs", tmp_path / "runs.old")  # what the message suggests
    assert JobStore(str(path)).insert(new_job())[0].id == "j1"


def test_another_stores_database_is_refused(tmp_path):
    fill(tmp_path / "a" / "jobs.sqlite", 2)
    fill(tmp_path / "b" / "jobs.sqlite", 5)
    shutil.copy(tmp_path / "a" / "jobs.sqlite", tmp_path / "b" / "jobs.sqlite")
    with pytest.raises(StoreError, match=r"b/runs/store.json gives .*b/runs \(5 job directories"):
        JobStore(str(tmp_path / "b" / "jobs.sqlite"))


def test_ids_are_never_reused_after_restoring_an_older_backup(tmp_path, caplog):
    path = tmp_path / "jobs.sqlite"
    fill(path, 2)
    shutil.copy(path, tmp_path / "backup.sqlite")
    fill(path, 3)  # j3..j5, then the database is lost and the backup comes back
    shutil.copy(tmp_path / "backup.sqlite", path)
    (tmp_path / "runs" / "j5" / "exit.json").write_text('{"exit_code": 0}')
    store = JobStore(str(path))
    assert caplog.messages == [
        f"{path}: its newest id is j2, but {tmp_path / 'runs' / 'j5'} exists (restored from a "
        "backup?): new ids start at j6"
    ]  # raised once on opening, not found one directory at a time
    job, _ = store.insert(new_job())
    assert job.id == "j6" and os.listdir(job.run_dir) == []
    assert (tmp_path / "runs" / "j5" / "exit.json").exists()  # the old job's files are its own


def test_a_run_dir_made_behind_the_stores_back_is_skipped(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    store.insert(new_job())
    os.mkdir(tmp_path / "runs" / "j2")
    job, _ = store.insert(new_job())
    assert job.id == "j3" and store.get("j2") is None
    assert store.insert(new_job())[0].id == "j4"


def test_corrupt_or_newer_database_is_a_clear_error(tmp_path):
    path = tmp_path / "jobs.sqlite"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match=r"jobs.sqlite: not a usable job database \(file is not"):
        JobStore(str(path))
    path.unlink()
    fill(path, 1)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match=r"schema version 99 is newer than this launcher's \(3\)"):
        JobStore(str(path))


def test_a_failed_write_surfaces_as_it_is_and_the_store_recovers(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    store.insert(new_job())
    db = store._db()  # this thread's connection: make the disk "full" for it
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    db.execute(f"PRAGMA max_page_count = {pages}")
    big = new_job(name="big")
    big.exit_reason = "x" * 200_000
    with pytest.raises(sqlite3.OperationalError, match="^database or disk is full$"):
        store.insert(big)
    assert not os.path.exists(tmp_path / "runs" / "j2")  # the failed insert took its dir back
    db.execute("PRAGMA max_page_count = 1000000")  # the disk has room again
    job, created = store.insert(big)
    assert created and job.id == "j2"
    stored = store.get("j2")
    assert stored is not None and stored.exit_reason == big.exit_reason


V1_SCHEMA = """
CREATE TABLE jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, state INTEGER NOT NULL, team TEXT NOT NULL,
  owner TEXT NOT NULL, pool TEXT NOT NULL, request_id TEXT UNIQUE,
  attempt_token TEXT NOT NULL DEFAULT '', job BLOB NOT NULL
);
CREATE INDEX jobs_state ON jobs (state, seq);
CREATE INDEX jobs_team ON jobs (team, seq);
"""


def test_a_version_1_database_is_migrated(tmp_path):
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
