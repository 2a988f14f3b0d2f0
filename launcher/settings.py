"""The launcher's config: a `kitchen.v1.LauncherConfig` (YAML or flags) with its defaults filled.

Defaults live here and nowhere else: `resolve(cfg)` returns a copy where every unset field
has its value, so the rest of the launcher reads fields without guessing.
"""

import os
import shutil
import sys

from launcher.executors import image
from protos import launcher_pb2
from protos.config_yaml import ConfigError
from protos.exposure import Gap, exposure_gaps, is_loopback, read_secret_file
from protos.paths import image_cache_dir, state_dir, tracking_dir, user_path

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_METRICS_LISTEN = "127.0.0.1:9464"
DEFAULT_HANG_TIMEOUT_SECONDS = 1800.0
DEFAULT_KILL_GRACE_SECONDS = 60.0
DEFAULT_RETENTION_SECONDS = 900.0
DEFAULT_POLL_INTERVAL_SECONDS = 0.5
DEFAULT_LEASE_SECONDS = 5.0  # replicas: a dead leader is replaced within ~1.2x this
MAX_WORKERS = 512  # gRPC handler threads: every progress stream, watch and followed log holds one
DEFAULT_STREAMS_PER_CALLER = 32
UNARY_RESERVE = 64  # threads no stream may take: GetJob, SubmitJob, ... always find one
DEFAULT_STREAM_IDLE_SECONDS = 600.0
DEFAULT_SPOOL_MAX_BYTES = 256 << 20
DEFAULT_TRACKING_FLUSH_SECONDS = 2.0
WORKSPACE = "kitchen"  # Bazel workspace name: runfiles hold `kitchen/trainer/train`


def _runfiles_dirs():
    for var in ("RUNFILES_DIR", "PYTHON_RUNFILES", "TEST_SRCDIR"):
        if os.environ.get(var):
            yield os.environ[var]
    yield os.path.abspath(sys.argv[0]) + ".runfiles"
    here = os.path.abspath(__file__)
    if ".runfiles" in here:
        yield here[: here.index(".runfiles") + len(".runfiles")]


def default_trainer_cmd() -> list:
    """The trainer binary from this program's Bazel runfiles (`//trainer:train` is a data
    dependency of `//launcher:submit`), else `python -m trainer.main` from the source tree."""
    for runfiles in _runfiles_dirs():
        candidate = os.path.join(runfiles, WORKSPACE, "trainer", "train")
        if os.access(candidate, os.X_OK):
            return [candidate]
    return [sys.executable, "-m", "trainer.main"]


def default_run_image_cmd() -> list:
    """The image runner from the runfiles (`//tools/oci:run_image` is a data dependency of
    `//launcher:settings`), else `python tools/oci/run_image.py` from the source tree."""
    for runfiles in _runfiles_dirs():
        candidate = os.path.join(runfiles, WORKSPACE, "tools", "oci", "run_image")
        if os.access(candidate, os.X_OK):
            return [candidate]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, os.path.join(root, "tools", "oci", "run_image.py")]


def trainer_env() -> dict:
    """Environment a trainer started from here needs to import the same modules."""
    return {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}


def embedded_tracking_uri(state: str) -> str:
    """The MLflow store a launcher with no tracking.uri writes (`kitchen mlflow` serves it)."""
    return "sqlite:///" + os.path.join(tracking_dir(state), "mlflow.db")


def resolve(cfg: launcher_pb2.LauncherConfig) -> launcher_pb2.LauncherConfig:
    out = launcher_pb2.LauncherConfig()
    out.CopyFrom(cfg)
    out.listen = out.listen or DEFAULT_LISTEN
    out.metrics_listen = out.metrics_listen or DEFAULT_METRICS_LISTEN
    out.state_dir = user_path(out.state_dir) or state_dir()
    for field in ("tokens_file", "tls_cert", "tls_key"):
        setattr(out, field, user_path(getattr(out, field)))
    out.exposure.metrics_token_file = user_path(out.exposure.metrics_token_file)
    if not out.pools:
        out.pools.add(name="cpu", executor=launcher_pb2.LOCAL, nodes=1)
    names = set()
    for i, pool in enumerate(out.pools):
        if not pool.name:
            raise ConfigError(f"pools[{i}].name", "every pool needs a name")
        if pool.name in names:
            raise ConfigError(f"pools[{i}].name", f"pool {pool.name!r} is defined twice")
        names.add(pool.name)
        if pool.nodes < 0 or pool.gpus_per_node < 0:
            raise ConfigError(f"pools[{i}]", "nodes and gpus_per_node cannot be negative")
        pool.nodes = pool.nodes or 1
        pool.kubernetes.kubeconfig = user_path(pool.kubernetes.kubeconfig)
        pool.executor = pool.executor or launcher_pb2.LOCAL
        if pool.executor == launcher_pb2.KUBERNETES and pool.kubernetes.image:
            image.check(pool.kubernetes.image, pulled=True, field=f"pools[{i}].kubernetes.image")
    out.default_pool = out.default_pool or out.pools[0].name
    if out.default_pool not in names:
        raise ConfigError("default_pool", f"no pool named {out.default_pool!r}")
    for i, quota in enumerate(out.quotas):
        if not quota.team:
            raise ConfigError(f"quotas[{i}].team", "a quota needs a team")
    if not out.trainer_cmd:
        out.trainer_cmd.extend(default_trainer_cmd())
    for i, arg in enumerate(out.trainer_cmd):  # trainers run in their run dir, not here
        if not os.path.isabs(arg) and os.path.exists(user_path(arg)):
            out.trainer_cmd[i] = user_path(arg)
    if not out.torchrun_cmd:
        out.torchrun_cmd.extend([sys.executable, "-m", "torch.distributed.run"])
    images = out.images
    if not images.run_image_cmd:
        images.run_image_cmd.extend(default_run_image_cmd())
    images.runtime = images.runtime or "bwrap"
    if images.runtime not in ("bwrap", "runc"):
        raise ConfigError("images.runtime", f"{images.runtime!r}: use bwrap or runc")
    images.cache_dir = user_path(images.cache_dir) or image_cache_dir(out.state_dir)
    for i, path in enumerate(images.binds):
        images.binds[i] = user_path(path)
    _resolve_sandbox(out)
    streams = out.streams
    streams.per_caller = streams.per_caller or DEFAULT_STREAMS_PER_CALLER
    streams.total = streams.total or MAX_WORKERS - UNARY_RESERVE
    streams.idle_seconds = streams.idle_seconds or DEFAULT_STREAM_IDLE_SECONDS
    if not 0 < streams.total <= MAX_WORKERS - UNARY_RESERVE or streams.per_caller < 0:
        raise ConfigError(
            "streams.total", f"between 1 and {MAX_WORKERS - UNARY_RESERVE} (the server's threads "
            f"less {UNARY_RESERVE} kept for unary calls)",
        )  # fmt: skip
    tracking = out.tracking
    tracking.uri = tracking.uri or embedded_tracking_uri(out.state_dir)
    tracking.spool_max_bytes = tracking.spool_max_bytes or DEFAULT_SPOOL_MAX_BYTES
    tracking.flush_seconds = tracking.flush_seconds or DEFAULT_TRACKING_FLUSH_SECONDS
    if tracking.spool_max_bytes < 0 or tracking.flush_seconds < 0:
        raise ConfigError("tracking", "spool_max_bytes and flush_seconds cannot be negative")
    out.hang_timeout_seconds = out.hang_timeout_seconds or DEFAULT_HANG_TIMEOUT_SECONDS
    out.kill_grace_seconds = out.kill_grace_seconds or DEFAULT_KILL_GRACE_SECONDS
    out.metrics_retention_seconds = out.metrics_retention_seconds or DEFAULT_RETENTION_SECONDS
    out.poll_interval_seconds = out.poll_interval_seconds or DEFAULT_POLL_INTERVAL_SECONDS
    if bool(out.tls_cert) != bool(out.tls_key):
        raise ConfigError("tls_cert", "TLS needs both tls_cert and tls_key")
    _check_exposure(out)
    _resolve_store(out)
    return out


def _resolve_store(cfg: launcher_pb2.LauncherConfig) -> None:
    if not cfg.store.HasField("postgres"):
        return  # SQLite in the state dir
    pg = cfg.store.postgres
    if bool(pg.dsn_file) == bool(pg.dsn_env):
        raise ConfigError(
            "store.postgres", "set one of dsn_file and dsn_env (the connection string is never "
            "written in the config: it may hold a password)",
        )  # fmt: skip
    pg.dsn_file = user_path(pg.dsn_file)
    pg.lease_seconds = pg.lease_seconds or DEFAULT_LEASE_SECONDS
    if not 0.5 <= pg.lease_seconds <= 3600:
        raise ConfigError("store.postgres.lease_seconds", "between 0.5 and 3600 seconds")
    if pg.replica_addresses and not pg.replicas:
        raise ConfigError(
            "store.postgres.replica_addresses", "only with replicas: true (one launcher has no "
            "other address for its trainers to report to)",
        )  # fmt: skip
    for i, address in enumerate(pg.replica_addresses):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or "," in address:
            raise ConfigError(
                f"store.postgres.replica_addresses[{i}]", f"{address!r} is not HOST:PORT"
            )
    store_dsn(cfg)  # readable and set, now rather than when the store opens


def store_dsn(cfg: launcher_pb2.LauncherConfig) -> str:
    """The PostgreSQL connection string of store.postgres, from its file or environment
    variable. It may hold a password: no message here repeats it."""
    pg = cfg.store.postgres
    if pg.dsn_env:
        field, dsn = "store.postgres.dsn_env", os.environ.get(pg.dsn_env, "")
        if not dsn:
            raise ConfigError(field, f"the environment variable {pg.dsn_env} is not set or empty")
        return dsn.strip()
    field = "store.postgres.dsn_file"
    try:
        with open(pg.dsn_file, encoding="utf-8") as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                raise ConfigError(
                    field, f"{pg.dsn_file} may be read by group or others: chmod 600 it (it "
                    "may hold the database password)",
                )  # fmt: skip
            dsn = f.read().strip()
    except OSError as err:
        raise ConfigError(field, f"{pg.dsn_file}: cannot read: {err.strerror}") from None
    if not dsn:
        raise ConfigError(field, f"{pg.dsn_file} is empty")
    return dsn


def _resolve_sandbox(cfg: launcher_pb2.LauncherConfig) -> None:
    box = cfg.sandbox
    local = any(p.executor == launcher_pb2.LOCAL for p in cfg.pools)
    if (
        box.mode == launcher_pb2.SANDBOX_MODE_UNSPECIFIED
        and local
        and not cfg.tokens_file
        and not shutil.which("bwrap")
    ):
        # A launcher with auth off is one user's (nothing to hide from its jobs: they are
        # theirs); without bubblewrap (e.g. inside the launcher's own image) its default is a
        # plain subprocess, said at start. Asked for explicitly, or with auth on, it refuses.
        print(
            "launcher: no bwrap on PATH: local jobs run unsandboxed (auth is off); install "
            "bubblewrap or set sandbox.mode",
            file=sys.stderr,
            flush=True,
        )
        box.mode = launcher_pb2.SANDBOX_NONE
    box.mode = box.mode or launcher_pb2.SANDBOX_BWRAP
    for i, path in enumerate(box.readonly):
        box.readonly[i] = user_path(path)
    if box.mode == launcher_pb2.SANDBOX_NONE and cfg.tokens_file:
        raise ConfigError(
            "sandbox.mode",
            "SANDBOX_NONE with tokens_file: a shared launcher runs other teams' jobs, which "
            "would read its state and tokens; keep SANDBOX_BWRAP",
        )
    if box.mode == launcher_pb2.SANDBOX_BWRAP and local and not shutil.which("bwrap"):
        raise ConfigError(
            "sandbox.mode",
            "local pools run jobs under bubblewrap, and there is no bwrap on PATH: install it "
            "(Debian: bubblewrap), or set SANDBOX_NONE (auth off only)",
        )


def metrics_token(cfg: launcher_pb2.LauncherConfig) -> str:
    """The bearer token /metrics asks for ("": open), from exposure.metrics_token_file."""
    path = cfg.exposure.metrics_token_file
    return read_secret_file(path, "exposure.metrics_token_file") if path else ""


def _check_exposure(cfg: launcher_pb2.LauncherConfig) -> None:
    """The rules of kitchen.v1.Exposure: refuse what would leak, fill the names default."""
    e = cfg.exposure
    gaps = exposure_gaps(
        cfg.listen.rpartition(":")[0],
        tls=bool(cfg.tls_cert),
        auth=bool(cfg.tokens_file),
        allow_plaintext=e.allow_plaintext,
        allow_unauthenticated=e.allow_unauthenticated,
    )
    if Gap.PLAINTEXT in gaps:
        raise ConfigError(
            "listen",
            f"{cfg.listen} is reachable from other machines, and without TLS bearer tokens "
            "and job specs travel in clear: set tls_cert and tls_key, or "
            "exposure.allow_plaintext: true on a trusted network",
        )
    if Gap.UNAUTHENTICATED in gaps:
        raise ConfigError(
            "listen",
            f"{cfg.listen} is reachable from other machines, and without tokens_file anyone "
            "there can submit and cancel jobs: set tokens_file, or "
            "exposure.allow_unauthenticated: true on a trusted network",
        )
    metrics_open = cfg.metrics_listen != "none" and not is_loopback(cfg.metrics_listen)
    if metrics_open and cfg.tokens_file and not e.metrics_token_file:
        raise ConfigError(
            "metrics_listen",
            f"{cfg.metrics_listen} is reachable from other machines and /metrics lists every "
            "team's jobs: set exposure.metrics_token_file (Prometheus sends it as a bearer "
            "token), or listen on 127.0.0.1",
        )
    metrics_token(cfg)  # readable and long enough, now rather than at the first scrape
    if not e.HasField("metrics_job_names"):
        e.metrics_job_names = not cfg.tokens_file
