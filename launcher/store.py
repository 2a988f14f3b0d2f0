"""The SQLite job store (the default): one file in WAL mode, every write committed before it
returns. What all stores share (ids, run directories, identity, idempotency keys, pages) is in
launcher/store_base.py; PostgreSQL is launcher/pg_store.py.

Writes use synchronous=FULL, so a state change that returned has reached the disk; readers
(ListJobs, GetJob) never wait for the writer. Each thread gets its own connection. A failed
write raises SQLite's own error (e.g. "database or disk is full") and leaves the store usable.
The schema version is SQLite's `PRAGMA user_version`.
"""

import contextlib
import logging
import os
import sqlite3
import threading

from launcher.store_base import (
    JobDirs,
    SqlStore,
    StoreError,
    spec_sha256,
    token_hash,
)
from protos import job_pb2

log = logging.getLogger("kitchen.launcher")

# PRAGMA user_version; 1: before meta, scoped request ids and spec hashes; 2: attempt tokens
# in plain text (3 keeps their SHA-256 only: a copy of the database forges no progress).
SCHEMA_VERSION = 3
_SCHEMA = (
    """CREATE TABLE jobs (
      seq INTEGER PRIMARY KEY AUTOINCREMENT,
      state INTEGER NOT NULL,
      team TEXT NOT NULL,
      owner TEXT NOT NULL,
      pool TEXT NOT NULL,
      request_id TEXT,  -- NULL: none given (NULLs never collide in a UNIQUE index)
      spec_sha256 TEXT,  -- with a request_id: the spec it was given with
      attempt_token TEXT NOT NULL DEFAULT '',  -- token_hash() of the attempt's token
      job BLOB NOT NULL
    )""",
    "CREATE UNIQUE INDEX jobs_request ON jobs (team, owner, request_id)",
    "CREATE INDEX jobs_state ON jobs (state, seq)",
    "CREATE INDEX jobs_team ON jobs (team, seq)",
    "CREATE INDEX jobs_attempt_token ON jobs (attempt_token)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)


class JobStore(SqlStore):
    def __init__(self, path: str, durable: bool = True):
        """Opens (or creates) the database at `path`; run directories go to `runs/` beside it.
        durable=False skips fsync (bulk fills in benchmarks); the launcher never uses it."""
        super().__init__(os.path.dirname(os.path.abspath(path)))
        self.path = self.name = path
        self.synchronous = "FULL" if durable else "OFF"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        dirs = JobDirs.scan(self.runs_dir)
        if dirs.count and not os.path.exists(path):
            raise StoreError(
                f"{path}: missing, but {self.runs_dir} holds {dirs}: refusing to reuse their "
                f"ids; restore the database or move {self.runs_dir} away"
            )
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # SQLite's -wal, -shm: the same
        os.chmod(path, 0o600)
        try:
            self.store_id = self._open_schema(dirs)
            self._check_identity(dirs)
            self._ids_above(dirs.newest)
        except sqlite3.DatabaseError as e:
            self.close()
            raise StoreError(
                f"{path}: not a usable job database ({e}); restore it from a backup or move it away"
            ) from e
        except BaseException:
            self.close()
            raise

    def _open_schema(self, dirs: JobDirs) -> str:
        """Creates or migrates the schema; returns the store id."""
        db = self._db()
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
        if version > SCHEMA_VERSION:
            raise self._newer_refused(version, SCHEMA_VERSION)
        if not tables:
            if dirs.count:
                raise self._empty_refused(dirs)
            with self._transaction() as db:
                for statement in _SCHEMA:
                    db.execute(statement)
                return self._new_identity(db)
        if "jobs" not in tables:
            raise StoreError(f"{self.path}: a SQLite database, but not a job store (no jobs table)")
        if version < 2:  # version 1 databases say 0 or 1
            return self._migrate_v1()
        if version == 2:
            with self._transaction() as db:
                _hash_tokens(db)
                db.execute("CREATE INDEX jobs_attempt_token ON jobs (attempt_token)")
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return self._stored_identity(db)

    def _migrate_v1(self) -> str:
        """Version 1 (request_id unique across all teams, no spec hash, no store id) to 2."""
        with self._transaction() as db:
            (sequence,) = db.execute(
                "SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'jobs'"
            ).fetchone()
            db.execute("DROP INDEX IF EXISTS jobs_state")
            db.execute("DROP INDEX IF EXISTS jobs_team")
            db.execute("ALTER TABLE jobs RENAME TO jobs_v1")
            for statement in _SCHEMA:
                db.execute(statement)
            db.execute(
                "INSERT INTO jobs (seq, state, team, owner, pool, request_id, attempt_token, job) "
                "SELECT seq, state, team, owner, pool, request_id, attempt_token, job FROM jobs_v1"
            )
            rows = db.execute("SELECT seq, job FROM jobs WHERE request_id IS NOT NULL").fetchall()
            db.executemany(
                "UPDATE jobs SET spec_sha256 = ? WHERE seq = ?",
                [(spec_sha256(job_pb2.Job.FromString(blob).spec), seq) for seq, blob in rows],
            )
            db.execute("DROP TABLE jobs_v1")
            _hash_tokens(db)
            self._set_sequence(db, sequence)
            log.info("%s: schema migrated from version 1 to %d", self.path, SCHEMA_VERSION)
            return self._new_identity(db)

    def _ids_above(self, newest: int):
        """New ids continue above the newest job directory (a database restored from a backup
        does not know the jobs made after it)."""
        with self._transaction() as db:
            (sequence,) = db.execute(
                "SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'jobs'"
            ).fetchone()
            if self._raised_above(sequence, newest):
                self._set_sequence(db, newest)

    @staticmethod
    def _set_sequence(db, sequence: int):
        db.execute("DELETE FROM sqlite_sequence WHERE name = 'jobs'")
        db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('jobs', ?)", (sequence,))

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            with self._lock:
                self._connections.append(db)
            self._local.db = db
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous}")
        return db

    @contextlib.contextmanager
    def _connection(self):
        yield self._db()  # autocommit: each statement outside a transaction commits itself

    def _new_row(self, db, row: tuple) -> int:
        sql = (
            "INSERT INTO jobs (state, team, owner, pool, request_id, spec_sha256, job) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)"
        )
        return db.execute(sql, row).lastrowid

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE ... COMMIT; on any error, ROLLBACK if SQLite has not already rolled
        back itself (it does on SQLITE_FULL: a second ROLLBACK would replace the real error)."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("%s: ROLLBACK failed; reconnecting", self.path)
                    self._local.db = None  # this thread's next call opens a fresh connection
            raise

    def close(self):
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()


def _hash_tokens(db) -> None:
    """Replaces the plain attempt tokens of a version 1 or 2 database by their hashes."""
    rows = db.execute(
        "SELECT seq, attempt_token FROM jobs WHERE attempt_token != '' "
        "AND attempt_token NOT LIKE 'sha256:%'"
    ).fetchall()
    db.executemany(
        "UPDATE jobs SET attempt_token = ? WHERE seq = ?", [(token_hash(t), q) for q, t in rows]
    )
