"""The leader lease and its fencing on a real PostgreSQL 15 (launcher/leader.py, pg_store.py):
two replicas' stores on one database; a lease runs out (set in the past, as a paused leader
would find it) and the other replica takes it; the former leader's writes are then refused and
its renewal fails; a follower writes nothing; a takeover waits for a write in flight; a cancel
request a follower stored is deleted only by the leader of the moment."""

import threading
import time

import psycopg
import pytest

from launcher.leader import Leadership, Lease
from launcher.pg_store import Fenced, PostgresStore
from launcher.testdata.postgres import running_postgres
from protos import job_pb2


@pytest.fixture(scope="module")
def postgres_server():
    with running_postgres() as pg:
        yield pg


@pytest.fixture
def two_replicas(postgres_server, tmp_path, request):
    dsn = postgres_server.create_database(request.node.name[:40].lower())
    state = str(tmp_path / "state")  # shared, as replicas share runs/
    stores = [PostgresStore(dsn, state, durable=False, replicas=True) for _ in range(2)]
    yield dsn, stores
    for store in stores:
        store.close()


def expire(dsn: str):
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("UPDATE leader SET expires_at = clock_timestamp() - interval '1 second'")


def new_job(store) -> job_pb2.Job:
    spec = job_pb2.JobSpec(name="j", kind=job_pb2.PRETRAIN)
    job, _ = store.insert(job_pb2.Job(spec=spec, pool="cpu", state=job_pb2.QUEUED))
    return job


def with_state(job: job_pb2.Job, state) -> job_pb2.Job:
    changed = job_pb2.Job()
    changed.CopyFrom(job)
    changed.state = state
    return changed


def test_a_replaced_leader_cannot_write_and_cannot_renew(two_replicas):
    dsn, (old, new) = two_replicas
    old_lease, new_lease = Lease(old, "127.0.0.1:1", 30), Lease(new, "127.0.0.1:2", 30)
    epoch = old_lease.acquire()
    assert epoch == 1 and new_lease.acquire() is None  # held: not taken
    old.epoch = epoch
    job = new_job(new)  # any replica takes submissions
    old.update(with_state(job, job_pb2.RUNNING))
    assert old_lease.renew(epoch)

    expire(dsn)  # the old leader paused past its lease
    assert new_lease.acquire() == epoch + 1
    new.epoch = epoch + 1
    assert new_lease.current().address == "127.0.0.1:2"
    refused: list[Fenced] = []
    old.on_fenced = refused.append
    with pytest.raises(Fenced, match="leads as epoch 1, the database's leader is epoch 2"):
        old.update(with_state(job, job_pb2.FAILED))
    assert len(refused) == 1
    assert new.get(job.id).state == job_pb2.RUNNING  # unchanged
    assert not old_lease.renew(epoch)
    new.update(with_state(job, job_pb2.SUCCEEDED))
    assert old.get(job.id).state == job_pb2.SUCCEEDED


def test_a_follower_writes_nothing(two_replicas):
    _, (follower, _) = two_replicas
    job = new_job(follower)
    with pytest.raises(Fenced, match="leads as epoch None"):
        follower.update(with_state(job, job_pb2.RUNNING))
    assert follower.get(job.id).state == job_pb2.QUEUED


def test_a_takeover_waits_for_the_write_in_flight(two_replicas):
    """The write's transaction holds the leader row FOR SHARE: a takeover's UPDATE waits for
    it, so no write of the old epoch lands after the new leader began. A trigger makes the
    write slow (1.5 s) so that the takeover comes while it is in flight."""
    dsn, (old, new) = two_replicas
    old.epoch = Lease(old, "a", 30).acquire()
    job = new_job(old)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(
            "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(1.5); RETURN NEW; END $$"
        )
        db.execute("CREATE TRIGGER slow BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION slow()")
    expire(dsn)
    order: list[str] = []

    def write():
        old.update(with_state(job, job_pb2.RUNNING))
        order.append("write")

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.5)  # the write is in its trigger now
    assert Lease(new, "b", 30).acquire() == 2
    order.append("takeover")
    writer.join()
    assert order == ["write", "takeover"]


def test_leadership_elects_one_and_hands_over_on_stop(two_replicas):
    _, (a, b) = two_replicas
    elected = {"a": threading.Event(), "b": threading.Event()}
    lost: list[str] = []

    def leadership(name: str, store: PostgresStore) -> Leadership:
        return Leadership(Lease(store, name, 1.0), lambda _epoch: elected[name].set(), lost.append)

    ships = {"a": leadership("a", a), "b": leadership("b", b)}
    ships["a"].start()
    assert elected["a"].wait(10)
    ships["b"].start()
    assert not elected["b"].wait(2.5)  # a renews: b stays a follower past two lease lengths
    ships["a"].stop(release=True)
    assert elected["b"].wait(10)
    assert (ships["b"].epoch, b.epoch) == (2, 2) and lost == []
    ships["b"].stop()


def test_a_cancel_request_is_deleted_only_by_the_leader_that_acted_on_it(two_replicas):
    dsn, (old, new) = two_replicas
    old_lease, new_lease = Lease(old, "127.0.0.1:1", 30), Lease(new, "127.0.0.1:2", 30)
    old.epoch = old_lease.acquire()
    job, other = new_job(new), new_job(new)
    new.request_cancel(job.id)  # a follower takes the cancel
    new.request_cancel(job.id)  # asked twice: one request
    new.request_cancel(other.id)
    assert old.cancel_requests() == [job.id, other.id] and old.cancel_requested(job.id)
    assert not new.cancel_request_done(job.id)  # a follower cannot take it away
    assert old.cancel_request_done(job.id)  # the leader, once it acted on it
    assert not old.cancel_requested(job.id) and old.cancel_requests() == [other.id]
    expire(dsn)
    new.epoch = new_lease.acquire()
    assert not old.cancel_request_done(other.id)  # replaced meanwhile: kept for the next
    assert new.cancel_requests() == [other.id]
    assert new.cancel_request_done(other.id)
    assert new.cancel_requests() == []
