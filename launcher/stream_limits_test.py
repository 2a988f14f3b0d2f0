"""No client can lock the launcher out: streams without a token never take a worker thread, one
caller's streams and all streams are capped below the thread count, silent progress streams end.
Real launchers with auth on; the attacker is a real gRPC client."""

import os
import threading
import time

import grpc
import pytest

from launcher.client import Client
from launcher.executors.base import attempt_dir
from launcher.testdata import harness as h
from protos import job_pb2, launcher_pb2, launcher_pb2_grpc

TOKENS = """
tokens:
  - {token: alice-token, user: alice, team: nlp}
  - {token: bob-token, user: bob, team: vision}
"""


@pytest.fixture
def make(tmp_path):
    started = []

    def launcher(**streams):
        (tmp_path / "tokens.yaml").write_text(TOKENS)
        cfg = h.config(tmp_path, tokens_file=str(tmp_path / "tokens.yaml"))
        cfg.streams.CopyFrom(launcher_pb2.StreamLimits(**streams))
        got = h.start(cfg)
        started.append(got)
        clients = {w: Client(got[0].address, token=f"{w}-token") for w in ("alice", "bob")}
        return got[0], clients

    yield launcher
    for server, client in started:
        client.close()
        server.stop()


def silent(stop: threading.Event):
    """A request stream that sends nothing until `stop`."""
    stop.wait()
    yield from ()


def progress_stub(launcher, token=None):
    channel = grpc.insecure_channel(launcher.address)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    return channel, launcher_pb2_grpc.LauncherStub(channel), metadata


def running_job(tmp_path, client, name="long"):
    h.behave(tmp_path, name, steps=100_000, step_seconds=0.05)
    job = client.submit(h.spec(name))
    return h.wait_for_step(client, job.id, 1)


def test_520_idle_progress_streams_without_a_token_lock_nobody_out(make, tmp_path):
    launcher, clients = make()
    job = running_job(tmp_path, clients["alice"])
    stop = threading.Event()
    channel, stub, _ = progress_stub(launcher)
    calls = [stub.ReportProgress.future(silent(stop)) for _ in range(520)]
    try:
        started = time.monotonic()
        for _ in range(20):  # every other caller is served meanwhile, at once
            assert clients["bob"].list().jobs == [] and clients["alice"].get(job.id, timeout=2)
        print(f"40 unary calls beside 520 idle streams: {time.monotonic() - started:.2f} s")
        codes = {c.exception(timeout=10).code() for c in calls}
        assert codes == {grpc.StatusCode.UNAUTHENTICATED}
    finally:
        stop.set()
        channel.close()


def test_one_user_holds_at_most_per_caller_streams(make, tmp_path):
    launcher, clients = make(per_caller=3)
    alice, bob = clients["alice"], clients["bob"]
    job = running_job(tmp_path, alice)
    watches = [alice.watch(job.id) for _ in range(3)]
    for w in watches:
        next(w)  # open: the first update arrived
    with pytest.raises(grpc.RpcError) as refused:
        next(alice.watch(job.id))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "user alice holds 3 streams already (streams.per_caller)" in refused.value.details()
    assert alice.get(job.id, timeout=2).id == job.id  # unary calls still served
    bob_job = bob.submit(h.spec("bobs"))
    next(bob.watch(bob_job.id))  # another user's streams are his own
    watches[0].cancel()
    h.wait_until(lambda: launcher.streams.open_count() <= 3, "the cancelled watch released")
    next(alice.watch(job.id))


def test_all_callers_together_hold_at_most_total_streams(make, tmp_path):
    launcher, clients = make(per_caller=10, total=3)
    alice, bob = clients["alice"], clients["bob"]
    job = running_job(tmp_path, alice)  # its trainer's progress stream is one
    bobs = bob.submit(h.spec("bobs"))
    held = [alice.watch(job.id) for _ in range(2)]
    for w in held:
        next(w)
    with pytest.raises(grpc.RpcError) as refused:
        next(bob.logs(bobs.id, follow=True))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(streams.total)" in refused.value.details()


def test_a_silent_progress_stream_is_cancelled_after_idle_seconds(make, tmp_path):
    launcher, clients = make(idle_seconds=0.5)
    job = running_job(tmp_path, clients["alice"])
    with open(os.path.join(attempt_dir(job.run_dir, 1), "token")) as f:
        token = f.read()
    stop = threading.Event()
    channel, stub, metadata = progress_stub(launcher, token)
    call = stub.ReportProgress.future(silent(stop), metadata=metadata)
    try:
        assert call.exception(timeout=10).code() == grpc.StatusCode.CANCELLED
    finally:
        stop.set()
        channel.close()
    assert h.wait_for_step(clients["alice"], job.id, job.progress.step + 5).state == job_pb2.RUNNING
