"""The job store: SQLite in WAL mode, one row per job, every write committed before it returns.

A row holds the `kitchen.v1.Job` message plus the columns that lists filter and sort on.
Writes use synchronous=FULL, so a state change that returned has reached the disk; readers
(ListJobs, GetJob) never wait for the writer. Each thread gets its own connection. A failed
write raises SQLite's own error (e.g. "database or disk is full") and leaves the store usable.

Job ids (`j<seq>`) are never given out twice, and neither are run directories:
- The store gives each new job its run directory `<runs>/<id>/` (`runs/` beside the database)
  and creates it in the same transaction, with an exclusive mkdir: a directory that already
  exists is never handed to a second job.
- The database holds a random store id (table `meta`), also written to `runs/store.json`.
- On open, one scan of `runs/` finds the newest job directory. The store refuses a database
  that is missing or empty (no schema) while `runs/` holds job directories (a lost database
  would otherwise hand their ids, and their old `exit.json`, to new jobs), and one whose
  store id is not the one `runs/store.json` names. A database restored from an older backup
  is accepted; its next id is raised above the newest job directory.
Idempotency keys (`request_id`) are scoped to the spec's team and owner, and bind the spec:
the same key with another spec is an error, not the first job.
"""

import base64
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import sqlite3
import threading
import time
import uuid

from protos import job_pb2
from protos.files import write_json_atomic
from protos.paths import run_dir_for, runs_dir

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
UNFINISHED = (job_pb2.QUEUED, job_pb2.STARTING, job_pb2.RUNNING, job_pb2.PREEMPTED)
MAX_PAGE_SIZE = 1000
STORE_MARKER = "store.json"  # in runs/: {"store_id": ...}, the database it belongs to


class PageTokenError(ValueError):
    pass


class StoreError(RuntimeError):
    """The database cannot be used as it is; the message names the file and what to do."""


class RequestIdReused(ValueError):
    """A request_id seen before with a different spec."""


def job_id(seq: int) -> str:
    return f"j{seq}"


# "j" and 1-18 ASCII digits, no leading zero: str.isdigit() would take "j\u0661" (an Arabic-Indic
# one) as job j1, and a 30-digit id would overflow SQLite's integers.
JOB_ID = re.compile(r"j[1-9][0-9]{0,17}", re.ASCII)


def seq_of(job_id: str) -> int | None:
    """The sequence number of a well-formed job id, else None (no such job)."""
    return int(job_id[1:]) if JOB_ID.fullmatch(job_id) else None


def token_hash(token: str) -> str:
    """What the store keeps of an attempt token ("" for none). A token is 24 random bytes, so
    a plain SHA-256 is as good as a slow hash here."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest() if token else ""


def spec_sha256(spec: job_pb2.JobSpec) -> str:
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()


@dataclasses.dataclass(frozen=True)
class JobDirs:
    """What `runs/` holds: the number of job directories and the highest seq among them."""

    count: int
    newest: int  # 0: none

    @classmethod
    def scan(cls, runs_dir: str) -> "JobDirs":
        count = newest = 0
        try:
            entries = os.scandir(runs_dir)
        except FileNotFoundError:
            return cls(0, 0)
        with entries:
            for entry in entries:
                seq = seq_of(entry.name)
                if seq is not None:
                    count += 1
                    newest = max(newest, seq)
        return cls(count, newest)

    def __str__(self) -> str:
        dirs = "directory" if self.count == 1 else "directories"
        return f"{self.count} job {dirs} ({job_id(self.newest)} is the newest)"


class JobStore:
    def __init__(self, path: str, durable: bool = True):
        """Opens (or creates) the database at `path`; run directories go to `runs/` beside it.
        durable=False skips fsync (bulk fills in benchmarks); the launcher never uses it."""
        self.path = path
        self.state_dir = os.path.dirname(os.path.abspath(path))
        self.runs_dir = runs_dir(self.state_dir)
        self.synchronous = "FULL" if durable else "OFF"
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # other local users read no job and no run directory
        os.makedirs(self.runs_dir, exist_ok=True)
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
            raise StoreError(
                f"{self.path}: schema version {version} is newer than this launcher's "
                f"({SCHEMA_VERSION}): run the launcher that wrote it, or a newer one"
            )
        if not tables:
            if dirs.count:
                raise StoreError(
                    f"{self.path}: empty, but {self.runs_dir} holds {dirs}: refusing to reuse "
                    f"their ids; restore the database or move {self.runs_dir} away"
                )
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
        row = db.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchone()
        if row is None:
            raise StoreError(f"{self.path}: no store id in table meta; restore it from a backup")
        return row[0]

    def _new_identity(self, db) -> str:
        store_id = uuid.uuid4().hex
        db.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [("store_id", store_id), ("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))],
        )
        return store_id

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

    def _check_identity(self, dirs: JobDirs):
        marker = os.path.join(self.runs_dir, STORE_MARKER)
        try:
            with open(marker) as f:
                owner = json.load(f)["store_id"]
        except FileNotFoundError:
            owner = None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{marker}: unreadable ({e!r}); it names the database of runs/") from e
        if owner == self.store_id:
            return
        if owner is not None and dirs.count:
            raise StoreError(
                f"{self.path}: store {self.store_id}, but {marker} gives {self.runs_dir} "
                f"({dirs}) to store {owner}: this is not their database; restore the right one "
                f"or move {self.runs_dir} away"
            )
        write_json_atomic(marker, {"store_id": self.store_id})

    def _ids_above(self, newest: int):
        """New ids continue above the newest job directory (a database restored from a backup
        does not know the jobs made after it)."""
        with self._transaction() as db:
            (sequence,) = db.execute(
                "SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'jobs'"
            ).fetchone()
            if newest > sequence:
                log.warning(
                    "%s: its newest id is %s, but %s exists (restored from a backup?): new ids "
                    "start at %s",
                    self.path, job_id(sequence), os.path.join(self.runs_dir, job_id(newest)),
                    job_id(newest + 1),
                )  # fmt: skip
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

    def insert(self, job: job_pb2.Job, request_id="", on_id=None) -> tuple[job_pb2.Job, bool]:
        """Stores a new job and gives it its id and run directory (created here; then
        `on_id(job)` may fill fields derived from them). With a request_id its team and owner
        used before for the same spec, returns the job stored the first time instead (second
        value False); for another spec, raises RequestIdReused."""
        digest = spec_sha256(job.spec) if request_id else None
        run_dir = None
        try:
            with self._transaction() as db:
                if request_id:
                    row = db.execute(
                        "SELECT spec_sha256, job FROM jobs "
                        "WHERE team = ? AND owner = ? AND request_id = ?",
                        (job.spec.team, job.spec.owner, request_id),
                    ).fetchone()
                    if row:
                        first = job_pb2.Job.FromString(row[1])
                        if row[0] != digest:
                            raise RequestIdReused(
                                f"request_id: {request_id!r} was used for job {first.id} with "
                                "a different spec; a new job needs a new request_id"
                            )
                        return first, False
                seq, run_dir = self._claim(db, job, request_id, digest)
                job.id, job.run_dir = job_id(seq), run_dir
                if on_id is not None:
                    on_id(job)
                if job.run_dir != run_dir:
                    raise ValueError(f"on_id moved run_dir to {job.run_dir}: the store owns it")
                db.execute("UPDATE jobs SET job = ? WHERE seq = ?", (job.SerializeToString(), seq))
        except BaseException:
            if run_dir is not None:
                with contextlib.suppress(OSError):  # a leftover only makes ids skip one
                    os.rmdir(run_dir)
            raise
        return job, True

    def _claim(self, db, job: job_pb2.Job, request_id: str, digest: str | None):
        """A new row and its run directory; an id whose directory exists already is skipped.
        The mkdir is not fsynced: the committed row is the durable record, and a directory
        lost in a crash is made again when the job starts."""
        while True:
            seq = db.execute(
                "INSERT INTO jobs (state, team, owner, pool, request_id, spec_sha256, job) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job.state, job.spec.team, job.spec.owner, job.pool, request_id or None, digest,
                 b""),
            ).lastrowid  # fmt: skip
            run_dir = run_dir_for(self.state_dir, job_id(seq))
            try:
                os.mkdir(run_dir)
                return seq, run_dir
            except FileExistsError:
                log.warning("%s exists, but no job has that id: skipping it", run_dir)
                db.execute("DELETE FROM jobs WHERE seq = ?", (seq,))  # the sequence stays

    def update(self, job: job_pb2.Job, attempt_token: str | None = None):
        """Writes the job's new state durably (and the hash of the attempt's token when given)."""
        seq = seq_of(job.id)
        row = (job.state, job.pool, job.SerializeToString())
        if attempt_token is None:
            self._db().execute("UPDATE jobs SET state=?, pool=?, job=? WHERE seq=?", (*row, seq))
        else:
            self._db().execute(
                "UPDATE jobs SET state=?, pool=?, job=?, attempt_token=? WHERE seq=?",
                (*row, token_hash(attempt_token), seq),
            )

    def get(self, job_id: str) -> job_pb2.Job | None:
        seq = seq_of(job_id)
        if seq is None:
            return None
        row = self._db().execute("SELECT job FROM jobs WHERE seq = ?", (seq,)).fetchone()
        return job_pb2.Job.FromString(row[0]) if row else None

    def attempt_token_matches(self, job_id: str, given: str) -> bool:
        """Whether `given` is the token of the job's current attempt."""
        seq = seq_of(job_id)
        row = self._db().execute("SELECT attempt_token FROM jobs WHERE seq=?", (seq,)).fetchone()
        expected = row[0] if row else ""
        return bool(expected and given) and hmac.compare_digest(expected, token_hash(given))

    def attempt_token_known(self, given: str) -> bool:
        """Whether `given` is the token of some job's current attempt (one index lookup)."""
        if not given:
            return False
        row = (
            self._db()
            .execute("SELECT 1 FROM jobs WHERE attempt_token = ? LIMIT 1", (token_hash(given),))
            .fetchone()
        )
        return row is not None

    def team_of(self, job_id: str) -> str | None:
        """The team of a stored job (None: no such job)."""
        seq = seq_of(job_id)
        row = self._db().execute("SELECT team FROM jobs WHERE seq=?", (seq,)).fetchone()
        return row[0] if row else None

    def page(self, states=(), team="", owner="", pool="", page_size=100, page_token=""):
        """A page of jobs, newest first, and the token of the next page ("" at the end)."""
        page_size = min(page_size or 100, MAX_PAGE_SIZE)
        where, args = [], []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        for column, value in (("team", team), ("owner", owner), ("pool", pool)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        if page_token:
            where.append("seq < ?")
            args.append(_decode_token(page_token))
        sql = "SELECT seq, job FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        rows = self._db().execute(sql, (*args, page_size + 1)).fetchall()
        jobs = [job_pb2.Job.FromString(blob) for _, blob in rows[:page_size]]
        more = len(rows) > page_size
        return jobs, (_encode_token(rows[page_size - 1][0]) if more else "")

    def unfinished(self) -> list[job_pb2.Job]:
        """Every job not in a final state, oldest first (what a restarted launcher resumes)."""
        marks = ",".join("?" * len(UNFINISHED))
        rows = self._db().execute(
            f"SELECT job FROM jobs WHERE state IN ({marks}) ORDER BY seq", UNFINISHED
        )
        return [job_pb2.Job.FromString(blob) for (blob,) in rows]

    def counts(self) -> dict:
        """{(state, pool): number of jobs}."""
        rows = self._db().execute("SELECT state, pool, count(*) FROM jobs GROUP BY state, pool")
        return {(state, pool): n for state, pool, n in rows}


def _hash_tokens(db) -> None:
    """Replaces the plain attempt tokens of a version 1 or 2 database by their hashes."""
    rows = db.execute(
        "SELECT seq, attempt_token FROM jobs WHERE attempt_token != '' "
        "AND attempt_token NOT LIKE 'sha256:%'"
    ).fetchall()
    db.executemany(
        "UPDATE jobs SET attempt_token = ? WHERE seq = ?", [(token_hash(t), q) for q, t in rows]
    )


def _encode_token(seq: int) -> str:
    return base64.urlsafe_b64encode(f"before:{seq}".encode()).decode()


def _decode_token(token: str) -> int:
    try:
        kind, seq = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        if kind != "before":
            raise ValueError(kind)
        return int(seq)
    except (ValueError, UnicodeDecodeError) as e:
        raise PageTokenError(f"page_token: not a token this launcher gave out ({token!r})") from e
