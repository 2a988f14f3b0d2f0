"""The job store's two backends as store_test drives them: each opens a store on a state dir
`root/<where>`, runs SQL on its database, copies one database over another (as a backup is
restored), empties one, sets its schema version, and fills its disk."""

import shutil
import sqlite3
import uuid

import psycopg

from launcher import pg_store
from launcher.pg_store import PostgresStore
from launcher.store import SCHEMA_VERSION, JobStore


class Sqlite:
    """State dir `root/<where>`, its database `jobs.sqlite` in it."""

    name = "sqlite"
    version = SCHEMA_VERSION

    def __init__(self, root):
        self.root = root

    def path(self, where=""):
        return self.root / where / "jobs.sqlite"

    def open(self, where=""):
        return JobStore(str(self.path(where)))

    def db_name(self, where=""):
        return str(self.path(where))

    def sql(self, statement, where=""):
        with sqlite3.connect(self.path(where)) as db:
            rows = db.execute(statement).fetchall()
        db.close()
        return rows

    def copy(self, source, target):
        self.path(target).parent.mkdir(exist_ok=True)
        shutil.copy(self.path(source), self.path(target))

    def empty(self, where=""):
        self.path(where).write_bytes(b"")

    def set_version(self, version, where=""):
        self.sql(f"PRAGMA user_version = {version}", where)

    def fill_disk(self, store):  # this thread's connection may use no more pages
        db = store._db()
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        db.execute(f"PRAGMA max_page_count = {pages}")

    def free_disk(self, store):
        store._db().execute("PRAGMA max_page_count = 1000000")

    disk_full = (sqlite3.OperationalError, "^database or disk is full$")


class Postgres:
    """State dir `root/<where>`, its database a fresh one on the module's server."""

    name = "postgres"
    version = pg_store.SCHEMA_VERSION

    def __init__(self, root, server):
        self.root, self.server = root, server
        self.databases: dict[str, str] = {}

    def database(self, where):
        if where not in self.databases:
            self.databases[where] = f"t{uuid.uuid4().hex[:12]}"
            self.server.create_database(self.databases[where])
        return self.databases[where]

    def open(self, where=""):
        return PostgresStore(self.server.dsn(self.database(where)), str(self.root / where))

    def db_name(self, where=""):
        return pg_store.display_name(self.server.dsn(self.database(where)))

    def sql(self, statement, where=""):
        with psycopg.connect(self.server.dsn(self.database(where)), autocommit=True) as db:
            cursor = db.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def copy(self, source, target):  # as a backup is restored: same name, copied contents
        self.server.drop_database(self.database(target))
        self.server.create_database(self.database(target), template=self.database(source))

    def empty(self, where=""):
        self.server.drop_database(self.database(where))
        self.server.create_database(self.database(where))

    def set_version(self, version, where=""):
        self.sql(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'", where)

    # The database's disk cannot be filled here (it would take a small filesystem of its own):
    # a trigger raises PostgreSQL's own disk_full error for big rows, as the server would.
    def fill_disk(self, store):
        self.sql(
            "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'could not extend file: No space left on device' "
            "USING ERRCODE = 'disk_full'; END $$"
        )
        self.sql(
            "CREATE TRIGGER disk_full BEFORE INSERT OR UPDATE ON jobs FOR EACH ROW "
            "WHEN (length(NEW.job) > 100000) EXECUTE FUNCTION disk_full()"
        )

    def free_disk(self, store):
        self.sql("DROP TRIGGER disk_full ON jobs")

    disk_full = (psycopg.errors.DiskFull, "No space left on device")
