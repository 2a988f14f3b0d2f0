"""Launcher replicas on one real PostgreSQL, as real processes (launcher/leader.py): what the
failover tests share (launcher/replicas_e2e_test.py, tests/serve_failover_test.py,
tests/precook_failover_test.py)."""

import psycopg

from launcher.testdata import harness as h
from protos import launcher_pb2

LEASE_SECONDS = 2.0


def replicas(
    tmp_path, dsn: str, names=("a", "b"), cfg: launcher_pb2.LauncherConfig | None = None
) -> list[h.LauncherProcess]:
    """Replicas that know each other's addresses: their trainers report to whichever leads.
    `cfg`: the launcher config to share (h.config(tmp_path) by default); its store is set here."""
    addresses = [f"127.0.0.1:{h.free_port()}" for _ in names]
    cfg = cfg if cfg is not None else h.config(tmp_path, nodes=1)
    cfg.store.CopyFrom(
        launcher_pb2.StoreConfig(
            postgres=launcher_pb2.PostgresStore(
                dsn_env="KITCHEN_PG_DSN",
                replicas=True,
                lease_seconds=LEASE_SECONDS,
                replica_addresses=addresses,
            )
        )
    )
    env = {"KITCHEN_PG_DSN": dsn}
    return [
        h.LauncherProcess(tmp_path, cfg, env=env, name=name, listen=address)
        for name, address in zip(names, addresses, strict=True)
    ]


def leader(dsn: str) -> tuple[int, str]:
    """(epoch, address) of the lease as the database has it."""
    with psycopg.connect(dsn) as db:
        row = db.execute("SELECT epoch, address FROM leader").fetchone()
    assert row is not None
    return row[0], row[1]


def start_replicas(dsn: str, a: h.LauncherProcess, b: h.LauncherProcess) -> int:
    """Starts a, waits until it leads, then b; returns a's epoch."""
    a.start().close()
    h.wait_until(lambda: leader(dsn)[1] == a.address, "replica a takes the lease")
    b.start().close()
    return leader(dsn)[0]
