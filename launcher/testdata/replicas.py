"""Launcher replicas on one real PostgreSQL, as real processes (launcher/leader.py): what the
failover tests share (launcher/replicas_e2e_test.py, tests/serve_failover_test.py,
tests/precook_tasks_test.py)."""

import contextlib
from collections.abc import Iterator

import psycopg

from launcher.client import Client
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


@contextlib.contextmanager
def leading(dsn: str, a: h.LauncherProcess, b: h.LauncherProcess) -> Iterator[tuple[int, Client]]:
    """Starts a, waits until it leads, then b; yields a's epoch and a client given both
    addresses (a's first, so a failover shows). Closes the client and stops both on the way
    out, whatever the test left running."""
    try:
        a.start().close()
        h.wait_until(lambda: leader(dsn)[1] == a.address, "replica a takes the lease")
        b.start().close()
        with contextlib.closing(Client(f"{a.address},{b.address}")) as client:
            yield leader(dsn)[0], client
    finally:
        a.stop()
        b.stop()
