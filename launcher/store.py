"""The job store: SQLite in WAL mode, one row per job, every write committed before it returns.

A row holds the `kitchen.v1.Job` message plus the columns that lists filter and sort on.
Writes use synchronous=FULL, so a state change that returned has reached the disk; readers
(ListJobs, GetJob) never wait for the writer. Each thread gets its own connection.
"""

import base64
import os
import sqlite3
import threading

from protos import job_pb2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  state INTEGER NOT NULL,
  team TEXT NOT NULL,
  owner TEXT NOT NULL,
  pool TEXT NOT NULL,
  request_id TEXT UNIQUE,
  attempt_token TEXT NOT NULL DEFAULT '',
  job BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, seq);
CREATE INDEX IF NOT EXISTS jobs_team ON jobs (team, seq);
"""
UNFINISHED = (job_pb2.QUEUED, job_pb2.STARTING, job_pb2.RUNNING, job_pb2.PREEMPTED)
MAX_PAGE_SIZE = 1000


class PageTokenError(ValueError):
    pass


def job_id(seq: int) -> str:
    return f"j{seq}"


def seq_of(job_id: str) -> int | None:
    if job_id[:1] != "j" or not job_id[1:].isdigit():
        return None
    return int(job_id[1:])


class JobStore:
    def __init__(self, path: str, durable: bool = True):
        """durable=False skips fsync (bulk fills in benchmarks); the launcher never uses it."""
        self.path = path
        self.synchronous = "FULL" if durable else "OFF"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections = []
        with self._db() as db:
            db.executescript(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous}")
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    def close(self):
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()

    def insert(self, job: job_pb2.Job, request_id="", on_id=None) -> tuple[job_pb2.Job, bool]:
        """Stores a new job and gives it its id (then `on_id(job)` may fill fields derived from
        it). With a request_id seen before, returns the job stored the first time instead
        (second value False)."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            if request_id:
                row = db.execute(
                    "SELECT job FROM jobs WHERE request_id = ?", (request_id,)
                ).fetchone()
                if row:
                    db.execute("COMMIT")
                    return job_pb2.Job.FromString(row[0]), False
            cur = db.execute(
                "INSERT INTO jobs (state, team, owner, pool, request_id, job) VALUES (?,?,?,?,?,?)",
                (job.state, job.spec.team, job.spec.owner, job.pool, request_id or None, b""),
            )
            job.id = job_id(cur.lastrowid)
            if on_id is not None:
                on_id(job)
            db.execute(
                "UPDATE jobs SET job = ? WHERE seq = ?", (job.SerializeToString(), cur.lastrowid)
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return job, True

    def update(self, job: job_pb2.Job, attempt_token: str | None = None):
        """Writes the job's new state durably (and the attempt's token when given)."""
        seq = seq_of(job.id)
        row = (job.state, job.pool, job.SerializeToString())
        if attempt_token is None:
            self._db().execute("UPDATE jobs SET state=?, pool=?, job=? WHERE seq=?", (*row, seq))
        else:
            self._db().execute(
                "UPDATE jobs SET state=?, pool=?, job=?, attempt_token=? WHERE seq=?",
                (*row, attempt_token, seq),
            )

    def get(self, job_id: str) -> job_pb2.Job | None:
        seq = seq_of(job_id)
        if seq is None:
            return None
        row = self._db().execute("SELECT job FROM jobs WHERE seq = ?", (seq,)).fetchone()
        return job_pb2.Job.FromString(row[0]) if row else None

    def attempt_token(self, job_id: str) -> str:
        seq = seq_of(job_id)
        row = self._db().execute("SELECT attempt_token FROM jobs WHERE seq=?", (seq,)).fetchone()
        return row[0] if row else ""

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
