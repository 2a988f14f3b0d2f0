"""Which of several launcher replicas on one PostgreSQL database runs the control loop.

The database's table `leader` (one row: epoch, holder, address, expires_at) is a lease. A
replica takes it when it has expired, by the database's clock (never a replica's), and the
epoch goes up by one; the leader renews it every third of the lease. The epoch is the fencing
token: the store refuses every job update whose epoch is not the row's (pg_store.update), in
the same transaction that reads the row FOR SHARE, so a leader that was paused, partitioned or
slow past its lease cannot change a job once another replica has taken over.

A replica that is not the leader serves reads and takes submissions and cancels (QUEUED rows
and rows of cancel_requests the leader picks up, replica_inbox.py); a leader that finds its
lease taken (a renewal or a write refused) stops the process at once, as Kubernetes controllers
do: a supervisor restarts it as a follower. A new leader that cannot read what to adopt (the
database restarting as it took the lease) tries again (server.py). Takeover after a leader dies
takes at most the lease plus a fifth of it (the followers' retry interval); a leader that stops
cleanly hands the lease over at once.
"""

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

import psycopg

from launcher.pg_store import PostgresStore

log = logging.getLogger("kitchen.launcher")


@dataclasses.dataclass(frozen=True)
class Holder:
    epoch: int
    holder: str
    address: str
    expires_in: float  # seconds; negative: expired


class Lease:
    """The lease row, on a connection of its own (a busy pool never delays a renewal)."""

    def __init__(self, store: PostgresStore, address: str, seconds: float):
        self.store = store
        self.address = address
        self.seconds = seconds
        self.holder = f"{os.uname().nodename} pid {os.getpid()}"
        self._conn: psycopg.Connection | None = None

    def _execute(self, sql: str, args: tuple = ()):
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self.store._connect()
        return self._conn.execute(sql, args).fetchone()

    def acquire(self) -> int | None:
        """The new epoch if the lease had expired and is now ours, else None."""
        row = self._execute(
            "UPDATE leader SET epoch = epoch + 1, holder = %s, address = %s, "
            "expires_at = clock_timestamp() + make_interval(secs => %s) "
            "WHERE id = 1 AND expires_at < clock_timestamp() RETURNING epoch",
            (self.holder, self.address, self.seconds),
        )
        return row[0] if row else None

    def renew(self, epoch: int) -> bool:
        """False: another replica has taken the lease since `epoch` began."""
        row = self._execute(
            "UPDATE leader SET expires_at = clock_timestamp() + make_interval(secs => %s) "
            "WHERE id = 1 AND epoch = %s RETURNING epoch",
            (self.seconds, epoch),
        )
        return row is not None

    def release(self, epoch: int) -> None:
        """Lets the next replica take over now rather than when the lease runs out."""
        self._execute(
            "UPDATE leader SET expires_at = '-infinity' WHERE id = 1 AND epoch = %s "
            "RETURNING epoch",
            (epoch,),
        )

    def current(self) -> Holder:
        row = self._execute(
            "SELECT epoch, holder, address, "
            "extract(epoch FROM expires_at - clock_timestamp())::float8 FROM leader WHERE id = 1"
        )
        expires_in = row[3] if row[3] is not None else float("-inf")  # '-infinity'
        return Holder(row[0], row[1], row[2], expires_in)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class Leadership:
    """Takes the lease when it is free and keeps it. `on_elected(epoch)` runs in a thread of
    its own (recovering many jobs may outlast a renewal period); `on_lost(reason)` runs when
    the lease turns out taken, and must stop this launcher from acting (server.py exits)."""

    def __init__(
        self,
        lease: Lease,
        on_elected: Callable[[int], None],
        on_lost: Callable[[str], None],
    ):
        self.lease = lease
        self.on_elected = on_elected
        self.on_lost = on_lost
        self.epoch: int | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kitchen-lease", daemon=True)
        self._failing = False

    def start(self) -> "Leadership":
        self._thread.start()
        return self

    @property
    def stopped(self) -> bool:
        """True once stop() began: no more taking office."""
        return self._stopping.is_set()

    def leader(self) -> Holder | None:
        """The lease as the database has it now (None: the database cannot say)."""
        try:
            return self.lease.current()
        except psycopg.Error:
            return None

    def _run(self):
        seconds = self.lease.seconds
        while not self._stopping.is_set():
            wait = seconds / 5
            try:
                if self.epoch is None:
                    epoch = self.lease.acquire()
                    if epoch is not None:
                        self._elected(epoch)
                        wait = seconds / 3
                elif self.lease.renew(self.epoch):
                    wait = seconds / 3
                else:
                    self.on_lost(f"the lease of epoch {self.epoch} was taken by another replica")
                    return
                if self._failing:
                    log.info("leader lease: the database answers again")
                    self._failing = False
            except psycopg.Error as e:  # the database down or restarting: try again soon
                if not self._failing:
                    log.warning("leader lease: %s: %s", self.lease.store.name, e)
                    self._failing = True
            self._stopping.wait(wait)

    def _elected(self, epoch: int):
        self.epoch = epoch
        self.lease.store.epoch = epoch
        log.info("leader: took the lease as epoch %d (%s, %s)", epoch, self.lease.holder,
                 self.lease.address)  # fmt: skip
        threading.Thread(
            target=self.on_elected, args=(epoch,), name="kitchen-elected", daemon=True
        ).start()

    def stop(self, release: bool = True):
        """Stops renewing; release=True (a clean stop) hands the lease over at once."""
        self._stopping.set()
        self._thread.join()
        if release and self.epoch is not None:
            try:
                self.lease.release(self.epoch)
            except psycopg.Error as e:
                log.warning("leader lease not released (%s): it expires within %.0f s", e,
                            self.lease.seconds)  # fmt: skip
        self.lease.close()
