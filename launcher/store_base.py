"""What every job store shares: the interface callers use, and the logic above the SQL.

Two backends implement `Store`: SQLite (launcher/store.py, the default: one file in the state
dir) and PostgreSQL (launcher/pg_store.py). Both keep one row per job holding the
`kitchen.v1.Job` message plus the columns that lists filter and sort on, and both write each
change durably before returning. `SqlStore` holds what does not depend on the database: the
queries (written with `?` placeholders), ids and run directories, idempotency keys, pages,
and the identity check against `runs/store.json`.

Job ids (`j<seq>`) are never given out twice, and neither are run directories:
- The store gives each new job its run directory `<runs>/<id>/` (`runs/` in the state dir)
  and creates it in the same transaction, with an exclusive mkdir: a directory that already
  exists is never handed to a second job.
- The database holds a random store id (table `meta`), also written to `runs/store.json`.
- On open, one scan of `runs/` finds the newest job directory. A store refuses a database that
  is missing or empty (no schema) while `runs/` holds job directories (a lost database would
  otherwise hand their ids, and their old `exit.json`, to new jobs), and one whose store id is
  not the one `runs/store.json` names. A database restored from an older backup is accepted;
  its next id is raised above the newest job directory.
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
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from protos import job_pb2
from protos.files import write_json_atomic
from protos.paths import run_dir_for, runs_dir

log = logging.getLogger("kitchen.launcher")

UNFINISHED = (job_pb2.QUEUED, job_pb2.STARTING, job_pb2.RUNNING, job_pb2.PREEMPTED)
MAX_PAGE_SIZE = 1000
STORE_MARKER = "store.json"  # in runs/: {"store_id": ...}, the database it belongs to


class PageTokenError(ValueError):
    pass


class StoreError(RuntimeError):
    """The database cannot be used as it is; the message names it and what to do."""


class RequestIdReused(ValueError):
    """A request_id seen before with a different spec."""


def job_id(seq: int) -> str:
    return f"j{seq}"


# "j" and 1-18 ASCII digits, no leading zero: str.isdigit() would take "j\u0661" (an Arabic-Indic
# one) as job j1, and a 30-digit id would overflow the databases' 64-bit integers.
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


class Store(Protocol):
    """The job store as the launcher uses it (server, controller, service, sandbox)."""

    name: str  # how messages name the database: a path, or postgresql://user@host:port/db
    store_id: str
    runs_dir: str

    def insert(
        self, job: job_pb2.Job, request_id: str = "", on_id: Callable | None = None
    ) -> tuple[job_pb2.Job, bool]: ...
    def update(self, job: job_pb2.Job, attempt_token: str | None = None) -> None: ...
    def get(self, job_id: str) -> job_pb2.Job | None: ...
    def attempt_token_matches(self, job_id: str, given: str) -> bool: ...
    def attempt_token_known(self, given: str) -> bool: ...
    def team_of(self, job_id: str) -> str | None: ...
    def page(
        self, states=(), team="", owner="", pool="", page_size=100, page_token=""
    ) -> tuple[list[job_pb2.Job], str]: ...
    def unfinished(self) -> list[job_pb2.Job]: ...
    def queued_after(self, seq: int) -> list[job_pb2.Job]: ...
    def counts(self) -> dict: ...
    def close(self) -> None: ...


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


class SqlStore:
    """The store's logic over a DB-API connection; a backend supplies the connections, its
    transactions and the few statements that differ (`_new_row`, `_lock_request_id`).
    `name` is how messages name the database (never with a password)."""

    name: str
    store_id: str

    def __init__(self, state_dir: str):
        self.state_dir = os.path.abspath(state_dir)
        self.runs_dir = runs_dir(self.state_dir)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # other local users read no job and no run directory
        os.makedirs(self.runs_dir, exist_ok=True)

    # ------------------------------------------------------------ what a backend supplies

    def _connection(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _transaction(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _new_row(self, db, row: tuple) -> int:
        """Inserts (state, team, owner, pool, request_id, spec_sha256, job); returns its seq."""
        raise NotImplementedError

    def _lock_request_id(self, db, team: str, owner: str, request_id: str) -> None:
        """Makes inserts with the same key wait for each other (SQLite's one writer does)."""

    def _read(self, sql: str, args: tuple = ()) -> list:
        with self._connection() as db:
            return db.execute(sql, args).fetchall()

    # ------------------------------------------------------------ opening

    def _empty_refused(self, dirs: JobDirs) -> StoreError:
        return StoreError(
            f"{self.name}: empty, but {self.runs_dir} holds {dirs}: refusing to reuse "
            f"their ids; restore the database or move {self.runs_dir} away"
        )

    def _newer_refused(self, version: int, known: int) -> StoreError:
        return StoreError(
            f"{self.name}: schema version {version} is newer than this launcher's "
            f"({known}): run the launcher that wrote it, or a newer one"
        )

    def _new_identity(self, db) -> str:
        store_id = uuid.uuid4().hex
        created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for key, value in (("store_id", store_id), ("created", created)):
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (key, value))
        return store_id

    def _stored_identity(self, db) -> str:
        row = db.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchone()
        if row is None:
            raise StoreError(f"{self.name}: no store id in table meta; restore it from a backup")
        return row[0]

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
                f"{self.name}: store {self.store_id}, but {marker} gives {self.runs_dir} "
                f"({dirs}) to store {owner}: this is not their database; restore the right one "
                f"or move {self.runs_dir} away"
            )
        write_json_atomic(marker, {"store_id": self.store_id})

    def _raised_above(self, sequence: int, newest: int) -> bool:
        """Whether new ids must skip to above `newest` (a database restored from a backup does
        not know the jobs made after it); warns once if so."""
        if newest <= sequence:
            return False
        log.warning(
            "%s: its newest id is %s, but %s exists (restored from a backup?): new ids "
            "start at %s",
            self.name, job_id(sequence), os.path.join(self.runs_dir, job_id(newest)),
            job_id(newest + 1),
        )  # fmt: skip
        return True

    # ------------------------------------------------------------ writes

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
                    self._lock_request_id(db, job.spec.team, job.spec.owner, request_id)
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
        row = (job.state, job.spec.team, job.spec.owner, job.pool, request_id or None, digest)
        while True:
            seq = self._new_row(db, (*row, b""))
            run_dir = run_dir_for(self.state_dir, job_id(seq))
            try:
                os.mkdir(run_dir)
                return seq, run_dir
            except FileExistsError:
                log.warning("%s exists, but no job has that id: skipping it", run_dir)
                db.execute("DELETE FROM jobs WHERE seq = ?", (seq,))  # the sequence stays

    def update(self, job: job_pb2.Job, attempt_token: str | None = None):
        """Writes the job's new state durably (and the hash of the attempt's token when given)."""
        with self._connection() as db:
            self._update(db, job, attempt_token)

    def _update(self, db, job: job_pb2.Job, attempt_token: str | None) -> None:
        seq = seq_of(job.id)
        row = (job.state, job.pool, job.SerializeToString())
        if attempt_token is None:
            db.execute("UPDATE jobs SET state=?, pool=?, job=? WHERE seq=?", (*row, seq))
        else:
            db.execute(
                "UPDATE jobs SET state=?, pool=?, job=?, attempt_token=? WHERE seq=?",
                (*row, token_hash(attempt_token), seq),
            )

    # ------------------------------------------------------------ reads

    def get(self, job_id: str) -> job_pb2.Job | None:
        seq = seq_of(job_id)
        if seq is None:
            return None
        rows = self._read("SELECT job FROM jobs WHERE seq = ?", (seq,))
        return job_pb2.Job.FromString(rows[0][0]) if rows else None

    def attempt_token_matches(self, job_id: str, given: str) -> bool:
        """Whether `given` is the token of the job's current attempt."""
        seq = seq_of(job_id)
        if seq is None:
            return False
        rows = self._read("SELECT attempt_token FROM jobs WHERE seq = ?", (seq,))
        expected = rows[0][0] if rows else ""
        return bool(expected and given) and hmac.compare_digest(expected, token_hash(given))

    def attempt_token_known(self, given: str) -> bool:
        """Whether `given` is the token of some job's current attempt (one index lookup)."""
        if not given:
            return False
        sql = "SELECT 1 FROM jobs WHERE attempt_token = ? LIMIT 1"
        return bool(self._read(sql, (token_hash(given),)))

    def team_of(self, job_id: str) -> str | None:
        """The team of a stored job (None: no such job)."""
        seq = seq_of(job_id)
        if seq is None:
            return None
        rows = self._read("SELECT team FROM jobs WHERE seq = ?", (seq,))
        return rows[0][0] if rows else None

    def page(self, states=(), team="", owner="", pool="", page_size=100, page_token=""):
        """A page of jobs, newest first, and the token of the next page ("" at the end)."""
        page_size = min(page_size or 100, MAX_PAGE_SIZE)
        where: list[str] = []
        args: list = []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(int(s) for s in states)
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
        rows = self._read(sql, (*args, page_size + 1))
        jobs = [job_pb2.Job.FromString(blob) for _, blob in rows[:page_size]]
        more = len(rows) > page_size
        return jobs, (_encode_token(rows[page_size - 1][0]) if more else "")

    def unfinished(self) -> list[job_pb2.Job]:
        """Every job not in a final state, oldest first (what a restarted launcher resumes)."""
        marks = ",".join("?" * len(UNFINISHED))
        sql = f"SELECT job FROM jobs WHERE state IN ({marks}) ORDER BY seq"
        return [job_pb2.Job.FromString(blob) for (blob,) in self._read(sql, UNFINISHED)]

    def queued_after(self, seq: int) -> list[job_pb2.Job]:
        """The QUEUED jobs above `seq`, oldest first: what other replicas took since (a leader
        picks them up, launcher/controller.py)."""
        sql = "SELECT job FROM jobs WHERE state = ? AND seq > ? ORDER BY seq"
        return [job_pb2.Job.FromString(b) for (b,) in self._read(sql, (job_pb2.QUEUED, seq))]

    def counts(self) -> dict:
        """{(state, pool): number of jobs}."""
        rows = self._read("SELECT state, pool, count(*) FROM jobs GROUP BY state, pool")
        return {(state, pool): n for state, pool, n in rows}


def _encode_token(seq: int) -> str:
    return base64.urlsafe_b64encode(f"before:{seq}".encode()).decode()


def _decode_token(token: str) -> int:
    try:
        kind, seq = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        if kind != "before" or not 0 < int(seq) < 2**63:  # a 64-bit seq, as the ids are
            raise ValueError(kind)
        return int(seq)
    except (ValueError, UnicodeDecodeError) as e:
        raise PageTokenError(f"page_token: not a token this launcher gave out ({token!r})") from e
