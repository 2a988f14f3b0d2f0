"""The launcher process: gRPC server (health, auth, TLS), control loop, store, /metrics.

    python -m launcher.server [--config launcher.yaml] [--listen 127.0.0.1:50051]
        [--metrics-listen 127.0.0.1:9464] [--state-dir DIR]
        [--trainer-cmd "python3 -m trainer.main"]

One launcher per state directory (a lock file enforces it). SIGTERM or Ctrl-C shuts down
gracefully: health turns NOT_SERVING, calls in flight get a grace period, progress is flushed.
Running jobs are left running; the next launcher on the same state dir re-attaches to them.
"""

import argparse
import fcntl
import logging
import os
import shlex
import signal
import sys
import threading
import time
from concurrent import futures
from wsgiref.simple_server import WSGIServer

import grpc

from launcher import metrics_http, settings
from launcher.auth import AuthInterceptor, TokenAuth
from launcher.controller import Controller
from launcher.events import JobEvents
from launcher.executors import sandbox
from launcher.executors.kubernetes import KubernetesExecutor
from launcher.executors.local import LocalExecutor
from launcher.executors.sandbox import Sandbox
from launcher.executors.slurm import SlurmExecutor
from launcher.health import NOT_SERVING, Health
from launcher.metrics import LauncherMetrics
from launcher.service import LauncherService
from launcher.store import JobStore
from launcher.store_base import Store, StoreError
from launcher.stream_limits import LimitInterceptor, Streams
from launcher.tracking.tracker import Tracker
from protos import launcher_pb2, launcher_pb2_grpc
from protos.config_yaml import ConfigError, load_message
from protos.paths import user_path

log = logging.getLogger("kitchen.launcher")
LOST_LEASE_EXIT = 3  # the exit status of a leader whose lease another replica took
ADOPT_RETRY_SECONDS, ADOPT_RETRY_MAX_SECONDS = 0.5, 5.0  # a new leader's recovery, retried


class StateDirBusy(RuntimeError):
    pass


def _executor(pool, cfg, confine: Sandbox | None):
    if pool.executor == launcher_pb2.SLURM:
        return SlurmExecutor(pool.slurm, list(cfg.torchrun_cmd), images=cfg.images)
    if pool.executor == launcher_pb2.KUBERNETES:
        return KubernetesExecutor(
            pool, list(cfg.torchrun_cmd), cfg.kill_grace_seconds, state_dir=cfg.state_dir
        )
    return LocalExecutor(list(cfg.torchrun_cmd), images=cfg.images, sandbox=confine)


def open_store(cfg: launcher_pb2.LauncherConfig) -> Store:
    """The store a resolved config names: PostgreSQL with store.postgres, else SQLite at
    <state_dir>/jobs.sqlite. Run directories are in the state dir either way."""
    if cfg.store.HasField("postgres"):
        from launcher.pg_store import PostgresStore  # psycopg loads only when it is used

        pg = cfg.store.postgres
        return PostgresStore(settings.store_dsn(cfg), cfg.state_dir, replicas=pg.replicas)
    return JobStore(os.path.join(cfg.state_dir, "jobs.sqlite"))


def _host_port(address: str):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Launcher:
    """Everything of one launcher, started with `start()` and stopped with `stop()`."""

    def __init__(self, cfg: launcher_pb2.LauncherConfig, env=None):
        self.cfg = settings.resolve(cfg)
        os.makedirs(self.cfg.state_dir, exist_ok=True)
        self.replicas = self.cfg.store.postgres.replicas
        # Replicas share the state dir (runs/ on a shared filesystem); the lease orders them.
        self._lock_file = None if self.replicas else self._lock_state_dir()
        self.store = open_store(self.cfg)
        self.auth = TokenAuth(self.cfg.tokens_file) if self.cfg.tokens_file else None
        self.events = JobEvents()
        self.health = Health()
        self.metrics = LauncherMetrics(
            self.cfg.metrics_retention_seconds, job_names=self.cfg.exposure.metrics_job_names
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(settings.MAX_WORKERS, thread_name_prefix="kitchen-rpc"),
            interceptors=self._interceptors(),
        )
        self.port = self._bind()
        host, _ = _host_port(self.cfg.listen)
        self.address = f"{host}:{self.port}"
        if not self.cfg.advertise:
            wildcard = host in ("0.0.0.0", "::", "")
            self.cfg.advertise = f"{os.uname().nodename}:{self.port}" if wildcard else self.address
        trainer_env = {**settings.trainer_env(), **(env or {})}
        confine = None
        if self.cfg.sandbox.mode == launcher_pb2.SANDBOX_BWRAP:
            readonly = sandbox.code_dirs(self.cfg, trainer_env)
            confine = Sandbox(self.cfg, readonly, self.store.team_of)
        executors = {p.name: _executor(p, self.cfg, confine) for p in self.cfg.pools}
        self.tracker = (
            None if self.cfg.tracking.uri == "none" else Tracker(self.cfg, self.metrics.registry)
        )
        self.controller = Controller(
            self.cfg, self.store, executors, self.metrics, self.events,
            auth=self.auth is not None, env=trainer_env, tracker=self.tracker,
            replicas=self.replicas,
        )  # fmt: skip
        self.metrics.fleet = self.controller.fleet
        self.leadership = None
        if self.replicas:
            from launcher.leader import Leadership, Lease  # psycopg: only with PostgreSQL
            from launcher.pg_store import PostgresStore

            assert isinstance(self.store, PostgresStore)  # replicas is a PostgreSQL setting
            lease = Lease(self.store, self.cfg.advertise, self.cfg.store.postgres.lease_seconds)
            self.leadership = Leadership(lease, self._lead, lost_lease)
            self.store.on_fenced = lambda e: lost_lease(str(e))
        service = LauncherService(
            self.cfg, self.store, self.controller, self.events, self.auth, self.leadership
        )
        launcher_pb2_grpc.add_LauncherServicer_to_server(service, self.server)
        self.server.add_generic_rpc_handlers((self.health.handler(),))
        self.metrics_port: int | None = None
        self._http: WSGIServer | None = None

    def _lock_state_dir(self):
        lock_file = open(os.path.join(self.cfg.state_dir, "launcher.lock"), "a+")  # noqa: SIM115
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            owner = lock_file.read().strip() or "another process"
            lock_file.close()
            raise StateDirBusy(
                f"state dir {self.cfg.state_dir} is in use by a launcher ({owner}); pass its "
                "address with --launcher, or use another state dir (KITCHEN_STATE_DIR)"
            ) from None
        return lock_file

    def _interceptors(self) -> list:
        """Strangers turned away first, then every stream counted (launcher/stream_limits.py)."""
        self.streams = Streams(self.cfg.streams)
        limits = LimitInterceptor(self.streams, self.auth)
        if self.auth is None:
            return [limits]
        return [AuthInterceptor(self.auth, self.store.attempt_token_known), limits]

    def _bind(self) -> int:
        if self.cfg.tls_cert:
            with open(self.cfg.tls_key, "rb") as k, open(self.cfg.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            port = self.server.add_secure_port(self.cfg.listen, creds)
        else:
            port = self.server.add_insecure_port(self.cfg.listen)
        if not port:
            raise OSError(f"cannot listen on {self.cfg.listen}")
        return port

    def _lead(self, epoch: int = 0):
        """Runs the control loop: at start, or with replicas once this one leads."""
        if self.tracker is not None:
            self.tracker.start()  # sends what a previous launcher left in the spool
        if not epoch:
            self.controller.start()  # recover first: re-attach before serving
            return
        # A new leader that cannot read what to adopt (the database restarting as it took the
        # lease) tries again: never a lease held with no control loop (every job unwatched).
        # recover() fails before the loop starts and files each job by id: again is safe.
        delay = ADOPT_RETRY_SECONDS
        while True:
            try:
                self.controller.start()
                break
            except Exception as e:
                if self.leadership is None or self.leadership.stopped:
                    return
                log.warning("leader (epoch %d): adopting the jobs failed (%s: %s); again in "
                            "%.1f s", epoch, type(e).__name__, e, delay)  # fmt: skip
                time.sleep(delay)
                delay = min(delay * 2, ADOPT_RETRY_MAX_SECONDS)
        log.info("leader (epoch %d): %d running and %d queued jobs adopted", epoch,
                 len(self.controller.jobs.live), len(self.controller.jobs.queued))  # fmt: skip

    def start(self):
        if self.leadership is None:
            self._lead()
        self.server.start()
        if self.leadership is not None:
            self.leadership.start()  # a follower until it takes the lease
        if self.cfg.metrics_listen != "none":
            token = settings.metrics_token(self.cfg)
            self._http = metrics_http.serve(self.metrics.registry, self.cfg.metrics_listen, token)
            self.metrics_port = self._http.server_port
        if self._lock_file is not None:
            self._lock_file.seek(0)
            self._lock_file.truncate()
            self._lock_file.write(f"pid {os.getpid()}, address {self.address}\n")
            self._lock_file.flush()
        log.info(
            "launcher serving on %s%s; state in %s; tracking %s; metrics %s",
            self.address, " (TLS)" if self.cfg.tls_cert else "", self.cfg.state_dir,
            self.cfg.tracking.uri,
            f"http://{self.cfg.metrics_listen.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"
            if self.metrics_port else "off",
        )  # fmt: skip
        return self

    def stop(self, grace: float = 5.0):
        self.health.set_all(NOT_SERVING)
        self.events.close()
        self.server.stop(grace).wait()
        self.streams.close()
        self.controller.stop()
        if self.leadership is not None:
            self.leadership.stop(release=True)  # the next replica takes over at once
        if self.tracker is not None:
            self.tracker.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.store.close()
        if self._lock_file is not None:
            self._lock_file.close()


def lost_lease(reason: str):
    """A leader that finds its lease taken stops at once, without a clean shutdown (that would
    write): its running jobs keep running under the new leader; a supervisor restarts it."""
    log.critical("lost the leader lease (%s): exiting; restart to rejoin as a follower", reason)
    logging.shutdown()
    os._exit(LOST_LEASE_EXIT)


def config_from_args(args) -> launcher_pb2.LauncherConfig:
    cfg = launcher_pb2.LauncherConfig()
    if args.config:
        load_message(user_path(args.config), cfg)
    for flag in ("listen", "metrics_listen", "state_dir", "tokens_file", "tls_cert", "tls_key"):
        if getattr(args, flag):
            setattr(cfg, flag, getattr(args, flag))
    if args.trainer_cmd:
        del cfg.trainer_cmd[:]
        cfg.trainer_cmd.extend(shlex.split(args.trainer_cmd))
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launcher", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="LauncherConfig YAML (pools, quotas, auth, TLS)")
    p.add_argument("--listen", help=f"gRPC address (default {settings.DEFAULT_LISTEN})")
    p.add_argument("--metrics-listen", help="Prometheus address, or 'none'")
    p.add_argument("--state-dir", help="store, run dirs and precook cache")
    p.add_argument("--trainer-cmd", help="trainer command prefix (default: //trainer:train)")
    p.add_argument("--tokens-file", help="bearer tokens YAML: turns auth on")
    p.add_argument("--tls-cert", help="PEM certificate chain: turns TLS on")
    p.add_argument("--tls-key", help="PEM private key")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        launcher = Launcher(config_from_args(args)).start()
    except (ConfigError, StateDirBusy, StoreError, OSError) as e:
        print(f"launcher: {e}", file=sys.stderr)
        return 2
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    log.info("shutting down; running jobs keep running and are re-attached at the next start")
    launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
