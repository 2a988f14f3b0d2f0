"""A real PostgreSQL server on 127.0.0.1 for tests: initdb in a temporary directory, one
password-protected superuser, stopped and removed afterwards. Used by the store's tests.

PostgreSQL refuses to run as root: as root (Bazel's tests here) initdb and postgres run as
the `postgres` user (subprocess's user/group: no runuser needed on PATH); as anyone else, as
that user. Each test takes a fresh
database of its own from `server.create_database()`: one server per test module keeps the
start (~2-5 s) out of every test. Tests run it with fsync off (`durable=False`): it is thrown
away, and the store's durability is not something a test could observe; the benchmark runs it
durable, as a real server, to compare with SQLite's fsync per write.
"""

import contextlib
import dataclasses
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import psycopg

USER = "kitchen"


def bin_dir() -> str | None:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    found.sort(key=lambda path: int(path.split("/")[4]))
    return os.path.dirname(found[-1]) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """The server process, restartable (the chaos soak restarts the database)."""

    def __init__(self, command: list, run_as: dict, log):
        self.command, self.run_as, self.log = command, run_as, log
        self.popen: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        self.popen = subprocess.Popen(self.command, stdout=self.log, stderr=self.log, **self.run_as)
        return self.popen


@dataclasses.dataclass(frozen=True)
class PostgresServer:
    port: int
    password: str
    root: str  # its directory: data/, server.log
    process: _Process | None = dataclasses.field(default=None, compare=False, repr=False)

    def restart(self, crash: bool = False) -> None:
        """Stops the server (crash=True: SIGQUIT, PostgreSQL's immediate shutdown: no
        checkpoint, WAL recovery at the start, as after a crash; else a fast shutdown) and
        starts it again on the same port and data; returns once it accepts connections."""
        assert self.process is not None and self.process.popen is not None
        if crash:
            self.process.popen.send_signal(signal.SIGQUIT)
            self.process.popen.wait(30)
        else:
            _stop(self.process.popen)
        _wait_ready(self, self.process.start(), os.path.join(self.root, "server.log"))

    def dsn(self, dbname: str = "postgres", password: str | None = None) -> str:
        password = self.password if password is None else password
        return (
            f"host=127.0.0.1 port={self.port} user={USER} password={password} dbname={dbname} "
            "connect_timeout=10"
        )

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn(), autocommit=True)

    def create_database(self, name: str, template: str = "template0") -> str:
        with self.admin() as db:
            db.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        with self.admin() as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def running_postgres(durable: bool = False) -> Iterator[PostgresServer]:
    bindir = bin_dir()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    # Under /tmp, traversable by everyone: as root, the server runs as user postgres.
    root = tempfile.mkdtemp(prefix="kpg-", dir="/tmp")
    as_root = os.geteuid() == 0
    as_postgres: dict = {"user": "postgres", "group": "postgres", "extra_groups": []}
    run_as = as_postgres if as_root else {}
    password = secrets.token_hex(16)
    pwfile = os.path.join(root, "password")
    with open(os.open(pwfile, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(password + "\n")
    if as_root:
        owner = pwd.getpwnam("postgres")
        for path in (root, pwfile):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    data = os.path.join(root, "data")
    log_path = os.path.join(root, "server.log")
    log = open(log_path, "ab")  # noqa: SIM115
    control: _Process | None = None
    try:
        subprocess.run(
            [f"{bindir}/initdb", "-D", data, "-U", USER, f"--pwfile={pwfile}",
             "--auth=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"],
            stdout=log, stderr=log, check=True, **run_as,
        )  # fmt: skip
        os.unlink(pwfile)
        port = free_port()
        fast = [] if durable else ["-c", "fsync=off", "-c", "full_page_writes=off"]
        control = _Process(
            [f"{bindir}/postgres", "-D", data, "-p", str(port),
             "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
             "-c", "max_connections=200", *fast],
            run_as, log,
        )  # fmt: skip
        server = PostgresServer(port, password, root, control)
        _wait_ready(server, control.start(), log_path)
        yield server
    finally:
        if control is not None and control.popen is not None:
            _stop(control.popen)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(server: PostgresServer, process: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            psycopg.connect(server.dsn(), connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as f:
                    raise RuntimeError(f"postgres did not start:\n{f.read()[-3000:]}") from None
            time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    """A fast shutdown (SIGINT: disconnect clients, then stop)."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
