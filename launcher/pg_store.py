"""The PostgreSQL job store (psycopg 3): the same store as SQLite's (launcher/store_base.py),
for a database that outlives the launcher's machine.

Connections come from a small pool (at most POOL_SIZE, opened when first needed; a broken one
is dropped and the next call opens a fresh one, so the store recovers when the server comes
back). Every statement outside a transaction commits on its own (autocommit), with
PostgreSQL's synchronous commit: a change that returned is on the server's disk.
What SQLite gets from its single writer is explicit here:
- job ids come from the sequence `job_ids`, which never goes back (a rolled-back insert only
  makes ids skip one);
- inserts with the same idempotency key wait for each other on a transaction advisory lock
  of (team, owner, request_id), so a retry racing the first call still gets the first job;
- opening runs under an advisory lock (two launchers never both create or migrate the schema)
  and raises the sequence above the newest run directory with `jobs` locked against inserts;
- one launcher per database, as one per state dir: an open store holds a session advisory
  lock, and a second launcher is refused naming the session that holds it; unless it is
  opened with replicas=True: then launchers share it, one leader writing job changes under
  the lease of table `leader` (launcher/leader.py), each write fenced by its epoch. A cancel
  sent to a replica that does not lead is a row of `cancel_requests`; the leader acts on it
  (fenced, as every job write) and only then deletes it, under its epoch too: a request is
  never lost to a leader replaced meanwhile (the next one acts on it again; a cancel twice is
  one).
The schema version is the row `schema_version` of table `meta`; MIGRATIONS[v] takes a database
from version v to v + 1. A launcher refuses a database newer than it knows, one that holds
other tables but no job store, and (like SQLite's) a lost or foreign one (store_base.py).
The connection string may hold a password: messages name the database by
`postgresql://user@host:port/dbname` only, and no connection error repeats the string.
"""

import contextlib
import json
import logging
import queue
import threading
from collections.abc import Callable

import psycopg
from psycopg import conninfo

from launcher.store_base import JobDirs, SqlStore, StoreError

log = logging.getLogger("kitchen.launcher")

SCHEMA_VERSION = 3
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 0 -> 1: the first schema (SQLite's version 3, with a sequence for the ids)
        "CREATE SEQUENCE job_ids",
        """CREATE TABLE jobs (
          seq BIGINT PRIMARY KEY DEFAULT nextval('job_ids'),
          state INTEGER NOT NULL,
          team TEXT NOT NULL,
          owner TEXT NOT NULL,
          pool TEXT NOT NULL,
          request_id TEXT,  -- NULL: none given (NULLs never collide in a UNIQUE index)
          spec_sha256 TEXT,  -- with a request_id: the spec it was given with
          attempt_token TEXT NOT NULL DEFAULT '',  -- token_hash() of the attempt's token
          job BYTEA NOT NULL
        )""",
        "ALTER SEQUENCE job_ids OWNED BY jobs.seq",
        "CREATE UNIQUE INDEX jobs_request ON jobs (team, owner, request_id)",
        "CREATE INDEX jobs_state ON jobs (state, seq)",
        "CREATE INDEX jobs_team ON jobs (team, seq)",
        "CREATE INDEX jobs_attempt_token ON jobs (attempt_token)",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    (  # 1 -> 2: the leader lease of replicated launchers (launcher/leader.py)
        """CREATE TABLE leader (
          id INTEGER PRIMARY KEY CHECK (id = 1),  -- one row
          epoch BIGINT NOT NULL,  -- the fencing token: +1 at each new leader
          holder TEXT NOT NULL,  -- host and pid, for people
          address TEXT NOT NULL,  -- its gRPC address
          expires_at TIMESTAMPTZ NOT NULL  -- the database's clock, never a replica's
        )""",
        "INSERT INTO leader VALUES (1, 0, '', '', '-infinity')",
    ),
    (  # 2 -> 3: cancels taken by a replica that does not lead, for the leader to act on
        """CREATE TABLE cancel_requests (
          job_id TEXT PRIMARY KEY,
          requested_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
        )""",
    ),
)
assert len(MIGRATIONS) == SCHEMA_VERSION
POOL_SIZE = 10  # a launcher's reads are single-row or one page: a few connections serve all
POOL_WAIT_SECONDS = 30.0
OPEN_LOCK = 0x6B69746368656E  # "kitchen" in ASCII: the advisory lock that serializes opening
LAUNCHER_LOCK = OPEN_LOCK + 1  # held for a store's life: one launcher per database
LOCK_WAIT_SECONDS = 5.0  # a launcher killed with -9 leaves its session within moments


def display_name(dsn: str) -> str:
    """postgresql://user@host:port/dbname of a connection string, without its password; the
    string itself is never shown (a parse error could quote it)."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise StoreError(
            "store.postgres: not a libpq connection string (key=value pairs or a "
            "postgresql:// URI); it is not repeated here as it may hold a password"
        ) from None
    user = params.get("user") or "(default user)"
    host = params.get("host") or params.get("hostaddr") or "(local socket)"
    port = params.get("port") or 5432
    return f"postgresql://{user}@{host}:{port}/{params.get('dbname') or user}"


class _Db:
    """A connection that takes the shared SQL's `?` placeholders (psycopg's are `%s`). Results
    come in binary: a page of 100 jobs' BYTEA decodes ~20% faster than from hex text."""

    def __init__(self, conn: psycopg.Connection):
        self.conn = conn

    def execute(self, sql: str, args: tuple | list = ()) -> psycopg.Cursor:
        return self.conn.execute(sql.replace("?", "%s"), args or None, binary=True)


class Fenced(StoreError):
    """A write of a leader whose lease another replica has taken since: refused."""


class PostgresStore(SqlStore):
    def __init__(self, dsn: str, state_dir: str, durable: bool = True, replicas: bool = False):
        """Opens (or creates the schema in) the database `dsn` names; run directories go to
        `<state_dir>/runs/`. durable=False turns synchronous commit off (bulk fills in
        benchmarks); the launcher never uses it. replicas=True: other launchers share the
        database (no LAUNCHER_LOCK); job updates are then fenced by `epoch`."""
        self.name = display_name(dsn)
        # With replicas: the leader epoch this launcher writes under (launcher/leader.py);
        # None: not the leader, and update() refuses. on_fenced(error) runs at a refused write.
        self.replicas = replicas
        self.epoch: int | None = None
        self.on_fenced: Callable[[Fenced], None] | None = None
        super().__init__(state_dir)
        self._dsn = dsn
        self._durable = durable
        self._idle: queue.LifoQueue[psycopg.Connection] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(POOL_SIZE)
        self._closed = False
        self._holder: psycopg.Connection | None = None
        dirs = JobDirs.scan(self.runs_dir)
        try:
            if not replicas:
                self._holder = self._hold_database()
            self._open(dirs)
        except psycopg.Error as e:
            self.close()
            raise StoreError(f"{self.name}: cannot open the job database: {e}") from None
        except BaseException:
            self.close()
            raise

    def _open(self, dirs: JobDirs):
        with self._transaction() as db:
            db.execute("SELECT pg_advisory_xact_lock(?)", (OPEN_LOCK,))
            tables = {
                name
                for (name,) in db.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                ).fetchall()
            }
            if not tables:
                if dirs.count:
                    raise self._empty_refused(dirs)
                self._migrate(db, 0)
                self.store_id = self._new_identity(db)
            else:
                self.store_id = self._existing(db, tables)
            self._check_identity(dirs)
            db.execute("LOCK TABLE jobs IN EXCLUSIVE MODE")  # no insert takes an id meanwhile
            last, called = db.execute("SELECT last_value, is_called FROM job_ids").fetchone()
            if self._raised_above(last if called else last - 1, dirs.newest):
                db.execute("SELECT setval('job_ids', ?)", (dirs.newest,))
        log.info("jobs in %s (schema version %d, store %s)", self.name, SCHEMA_VERSION,
                 self.store_id)  # fmt: skip

    def _hold_database(self) -> psycopg.Connection:
        """A session of its own holding LAUNCHER_LOCK until close(): two launchers (two state
        dirs) on one database would both run its jobs (replicas share one under a lease instead:
        launcher/leader.py); when the server drops this session (a restart), the lock goes."""
        conn = self._connect()
        try:
            conn.execute(f"SET lock_timeout = '{int(LOCK_WAIT_SECONDS * 1000)}ms'")
            conn.execute("SELECT pg_advisory_lock(%s)", (LAUNCHER_LOCK,))
            conn.execute("SET lock_timeout = 0")
            return conn
        except psycopg.errors.LockNotAvailable:
            holder = conn.execute(
                "SELECT coalesce(host(a.client_addr), 'a local socket'), a.pid, "
                "to_char(a.backend_start, 'YYYY-MM-DD HH24:MI:SS TZ') FROM pg_locks l "
                "JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' "
                "AND l.granted AND l.classid = %s AND l.objid = %s",
                (LAUNCHER_LOCK >> 32, LAUNCHER_LOCK & 0xFFFFFFFF),
            ).fetchone()
            conn.close()
            where = "from {} (server pid {}), connected {}".format(*holder) if holder else "gone"
            raise StoreError(
                f"{self.name}: in use by another launcher (its session: {where}): one launcher "
                "per database; stop that one, or give this one a database of its own"
            ) from None
        except BaseException:
            conn.close()
            raise

    def _existing(self, db, tables: set) -> str:
        """The store id of a database that holds tables, migrated to SCHEMA_VERSION."""
        row = None
        if {"jobs", "meta"} <= tables:
            row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            raise StoreError(
                f"{self.name}: a PostgreSQL database, but not a job store (tables: "
                f"{', '.join(sorted(tables))}); name an empty database, or the launcher's own"
            )
        if not row[0].isdigit():
            raise StoreError(f"{self.name}: schema_version {row[0]!r} in table meta: not a number")
        version = int(row[0])
        if version > SCHEMA_VERSION:
            raise self._newer_refused(version, SCHEMA_VERSION)
        self._migrate(db, version)
        return self._stored_identity(db)

    def _migrate(self, db, version: int):
        """Runs MIGRATIONS[version:], in the caller's transaction, and records the version."""
        for statements in MIGRATIONS[version:]:
            for statement in statements:
                db.execute(statement)
        if version < SCHEMA_VERSION:
            db.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(SCHEMA_VERSION),),
            )

    # ------------------------------------------------------------ connections

    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(self._dsn, autocommit=True)
        if not self._durable:
            conn.execute("SET synchronous_commit = off")
        return conn

    @contextlib.contextmanager
    def _connection(self):
        """One pooled connection for the caller's statements; waits while all are busy."""
        if not self._slots.acquire(timeout=POOL_WAIT_SECONDS):
            raise StoreError(f"{self.name}: all {POOL_SIZE} connections busy for 30 s")
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self._connect()
            try:
                yield _Db(conn)
            finally:
                if conn.closed or conn.broken or self._closed:
                    conn.close()  # the server went away (the next call connects afresh), or
                    # the store was closed while this call ran
                else:
                    self._idle.put(conn)
        finally:
            self._slots.release()

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN ... COMMIT on one connection; ROLLBACK on any error (psycopg's own)."""
        with self._connection() as db, db.conn.transaction():
            yield db

    def _new_row(self, db, row: tuple) -> int:
        sql = (
            "INSERT INTO jobs (state, team, owner, pool, request_id, spec_sha256, job) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq"
        )
        return db.execute(sql, row).fetchone()[0]

    def _lock_request_id(self, db, team: str, owner: str, request_id: str) -> None:
        key = json.dumps([team, owner, request_id])
        db.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (key,))

    def update(self, job, attempt_token=None):
        """With replicas, in one transaction with the leader row read FOR SHARE: a replica
        taking the lease (UPDATE leader) waits for this write, and every write after it sees
        the new epoch and is refused. A paused former leader cannot act once replaced."""
        if not self.replicas:
            return super().update(job, attempt_token)
        with self._transaction() as db:
            (epoch,) = db.execute("SELECT epoch FROM leader WHERE id = 1 FOR SHARE").fetchone()
            if self.epoch is None or epoch != self.epoch:
                error = Fenced(
                    f"{self.name}: {job.id} not written: this launcher leads as epoch "
                    f"{self.epoch}, the database's leader is epoch {epoch}"
                )
                if self.on_fenced is not None:
                    self.on_fenced(error)
                raise error
            self._update(db, job, attempt_token)

    # ------------------------------------------------------------ cancels via any replica

    def request_cancel(self, job_id: str) -> None:
        """Records a cancel for the leader to act on (a second request for the job is one)."""
        with self._connection() as db:
            db.execute(
                "INSERT INTO cancel_requests (job_id) VALUES (?) ON CONFLICT DO NOTHING",
                (job_id,),
            )

    def cancel_requests(self) -> list[str]:
        """The job ids of the cancels not acted on yet, oldest first."""
        rows = self._read("SELECT job_id FROM cancel_requests ORDER BY requested_at, job_id")
        return [job_id for (job_id,) in rows]

    def cancel_requested(self, job_id: str) -> bool:
        """True while a cancel of the job waits for the leader."""
        return bool(self._read("SELECT 1 FROM cancel_requests WHERE job_id = ?", (job_id,)))

    def cancel_request_done(self, job_id: str) -> bool:
        """Deletes the request once this leader acted on it; False (kept) when the leader is no
        longer `self.epoch`: the next one acts on it again."""
        with self._connection() as db:
            row = db.execute(
                "DELETE FROM cancel_requests WHERE job_id = ? AND "
                "(SELECT epoch FROM leader WHERE id = 1) = ? RETURNING job_id",
                (job_id, self.epoch if self.epoch is not None else -1),
            ).fetchone()
        return row is not None

    def close(self):
        self._closed = True
        if self._holder is not None:
            self._holder.close()  # the next launcher may take the database
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
