"""The gRPC service end to end: a real launcher on 127.0.0.1 running the fake trainer."""

import threading
from pathlib import Path

import grpc
import pytest

from launcher import health, server
from launcher.testdata import harness as h
from protos import job_pb2


@pytest.fixture
def launcher(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        yield launcher, client


def test_submit_runs_to_success_with_watch_and_logs(launcher, tmp_path):
    _, client = launcher
    job = client.submit(h.spec("ok", steps=4))
    assert job.state == job_pb2.QUEUED and job.run_dir.endswith(f"runs/{job.id}")
    states: list[job_pb2.JobState] = []
    for update in client.watch(job.id):
        if not states or states[-1] != update.state:
            states.append(update.state)
    assert states[-1] == job_pb2.SUCCEEDED
    assert job_pb2.RUNNING in states
    done = client.get(job.id)
    assert (done.attempts, done.failures, done.progress.step) == (1, 0, 4)
    # The summary report at the end leaves the last training numbers in place.
    assert (done.progress.phase, done.progress.message) == ("done", "done at step 4")
    assert done.progress.loss == 10.0 / 4 and done.progress.mfu == 0.25
    assert done.progress.total_steps == 4 and done.HasField("finished")
    logs = b"".join(c.data for c in client.logs(job.id)).decode()
    assert "===== attempt 1 =====" in logs and "done at step 4" in logs
    assert h.steps_log(done) == [(1, 1), (1, 2), (1, 3), (1, 4)]


def test_followed_logs_end_with_the_job(launcher, tmp_path):
    _, client = launcher
    h.behave(tmp_path, "slow", step_seconds=0.1)
    job = client.submit(h.spec("slow", steps=8))
    text = b"".join(c.data for c in client.logs(job.id, follow=True)).decode()
    assert "done at step 8" in text
    assert client.get(job.id).state == job_pb2.SUCCEEDED


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.ClearField("kind"), "spec.kind: a job needs a kind"),
        (lambda s: setattr(s, "name", "bad name!"), "spec.name: 'bad name!'"),
        (lambda s: setattr(s.resources, "pool", "gpu"), "spec.resources.pool: no pool 'gpu'"),
        (lambda s: setattr(s.resources, "nodes", 2), "spec.resources.nodes: 2 nodes, but pool"),
        (
            lambda s: setattr(s.trainer.model, "n_heads", 0),
            "spec.trainer.model.n_heads: 0 is not in [1, 1,024]",
        ),
        (
            lambda s: setattr(s.retry, "max_attempts", -1),
            "spec.retry.max_attempts: -1 is not in [0, 100]",
        ),
    ],
)
def test_bad_specs_are_rejected_and_nothing_is_stored(launcher, mutate, message):
    _, client = launcher
    spec = h.spec("bad")
    mutate(spec)
    with pytest.raises(grpc.RpcError) as err:
        client.submit(spec)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(message)
    assert list(client.list().jobs) == []


def test_cancel_queued_and_running_jobs(launcher, tmp_path):
    _, client = launcher
    h.behave(tmp_path, "long", steps=10_000, step_seconds=0.02)
    running = client.submit(h.spec("long"))
    queued = client.submit(h.spec("waiting"))
    h.wait_for_step(client, running.id, 1)  # the trainer has its SIGTERM handler by now
    cancelled = client.cancel(queued.id)
    assert cancelled.state == job_pb2.CANCELLED
    stopping = client.cancel(running.id)
    assert stopping.stop == job_pb2.STOP_CANCEL
    done = h.wait_for(client, running.id, h.FINAL)
    assert done.state == job_pb2.CANCELLED
    assert "SIGTERM: checkpoint" in b"".join(c.data for c in client.logs(running.id)).decode()
    assert client.cancel(running.id).state == job_pb2.CANCELLED  # idempotent
    # Unknown, Unicode-digit lookalikes of real ids, 30 digits: no such job, never another one.
    for alias in (
        "j999",
        "j\u0661",
        f"j{running.id[1:]}\u0660",
        "j0" + running.id[1:],
        "j" + "9" * 30,
    ):
        with pytest.raises(grpc.RpcError) as err:
            client.cancel(alias)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, alias


def test_queued_job_says_why_it_waits(launcher, tmp_path):
    _, client = launcher
    h.behave(tmp_path, "long", steps=10_000, step_seconds=0.02)
    first = client.submit(h.spec("long"))
    h.wait_for(client, first.id, [job_pb2.RUNNING])
    second = client.submit(h.spec("next"))
    third = client.submit(h.spec("after"))
    h.wait_for(client, third.id, [job_pb2.QUEUED])
    h.wait_until(lambda: client.get(third.id).waiting_reason, "a pass has seen the third job")
    assert client.get(second.id).waiting_reason == "pool cpu full (1/1 nodes in use)"
    assert client.get(third.id).waiting_reason == f"behind {second.id} (priority 0) in pool cpu"
    for job in (first, second, third):
        client.cancel(job.id)


def test_many_concurrent_clients_lose_nothing(launcher, tmp_path):
    launcher_, client = launcher
    h.behave(tmp_path, "blocker", steps=10_000, step_seconds=0.02)
    blocker = client.submit(h.spec("blocker"))  # holds the pool: the rest stay queued
    h.wait_for(client, blocker.id, [job_pb2.RUNNING])
    errors, ids = [], []
    lock = threading.Lock()

    def submit_many(worker):
        own = h.Client(launcher_.address)
        try:
            for i in range(20):
                request_id = f"w{worker}-{i}"
                job = own.submit(h.spec(f"w{worker}-{i}"), request_id=request_id)
                again = own.submit(h.spec(f"w{worker}-{i}"), request_id=request_id)
                assert again.id == job.id  # a retried submit is the same job
                own.list(page_size=20)
                with lock:
                    ids.append(job.id)
        except Exception as e:  # collected: a failure in a thread must fail the test
            errors.append(e)
        finally:
            own.close()

    threads = [threading.Thread(target=submit_many, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ids) == len(set(ids)) == 320
    listed, token = [], ""
    while True:
        page = client.list(states=[job_pb2.QUEUED], page_size=100, page_token=token)
        listed += [j.id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert sorted(listed) == sorted(ids)
    client.cancel(blocker.id)


def test_list_filters_and_bad_page_token(launcher):
    _, client = launcher
    a = client.submit(h.spec("a", team="nlp", owner="ann"))
    b = client.submit(h.spec("b", team="vision", owner="bob"))
    assert [j.id for j in client.list(team="nlp").jobs] == [a.id]
    assert [j.id for j in client.list(owner="bob").jobs] == [b.id]
    with pytest.raises(grpc.RpcError) as err:
        client.list(page_token="nope")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for job in (a, b):
        h.wait_for(client, job.id, h.FINAL)


def test_health_serving_then_not_serving_on_shutdown(tmp_path):
    launcher, client = h.start(h.config(tmp_path))
    assert health.check(client.channel) == health.SERVING
    assert health.check(client.channel, "kitchen.v1.Launcher") == health.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.check(client.channel, "nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    watch = client.channel.unary_stream(
        f"/{health.SERVICE}/Watch",
        request_serializer=health.HealthCheckRequest.SerializeToString,
        response_deserializer=health.HealthCheckResponse.FromString,
    )(health.HealthCheckRequest(service=""))
    assert next(watch).status == health.SERVING
    stopper = threading.Thread(target=launcher.stop, kwargs={"grace": 2.0})
    stopper.start()
    assert next(watch).status == health.NOT_SERVING  # seen before the server goes away
    stopper.join()
    client.close()


@pytest.fixture
def two_teams(tmp_path):
    """A launcher with auth on, and a client each for alice (team nlp) and bob (vision)."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        "tokens:\n"
        "  - {token: alice-token, user: alice, team: nlp}\n"
        "  - {token: bob-token, user: bob, team: vision}\n"
    )
    launcher = server.Launcher(h.config(tmp_path, tokens_file=str(tokens))).start()
    alice = h.Client(launcher.address, token="alice-token")
    bob = h.Client(launcher.address, token="bob-token")
    try:
        yield alice, bob
    finally:
        alice.close()
        bob.close()
        launcher.stop()


def test_request_ids_are_scoped_to_the_caller_and_bound_to_the_spec(two_teams):
    alice, bob = two_teams
    mine = alice.submit(h.spec("mine"), request_id="nightly")
    theirs = bob.submit(h.spec("theirs"), request_id="nightly")
    assert theirs.id != mine.id and theirs.run_dir != mine.run_dir
    assert (theirs.spec.name, theirs.spec.team) == ("theirs", "vision")
    assert alice.submit(h.spec("mine"), request_id="nightly").id == mine.id  # a retry
    with pytest.raises(grpc.RpcError) as err:
        alice.submit(h.spec("changed"), request_id="nightly")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.value.details() == (
        f"request_id: 'nightly' was used for job {mine.id} with a different spec; "
        "a new job needs a new request_id"
    )
    assert [j.id for j in bob.list().jobs] == [theirs.id]


def test_a_launcher_refuses_a_lost_database_with_a_clear_message(tmp_path, capsys):
    with h.started(h.config(tmp_path)) as (_, client):
        job = client.submit(h.spec("ok", steps=1))  # its run dir is made when it is stored
    state = tmp_path / "state"
    (state / "jobs.sqlite").unlink()
    args = ["--state-dir", str(state), "--listen", "127.0.0.1:0", "--metrics-listen", "none"]
    assert server.main(args) == 2
    assert capsys.readouterr().err == (
        f"launcher: {state / 'jobs.sqlite'}: missing, but {state / 'runs'} holds 1 job "
        f"directory ({job.id} is the newest): refusing to reuse their ids; restore the "
        f"database or move {state / 'runs'} away\n"
    )


def test_runs_are_found_by_name_in_the_callers_team_only(two_teams):
    """`run:NAME`: the newest checkpoint of the team's latest SUCCEEDED job of that name,
    resolved and recorded at submit (protos/run_refs.py); another team's run is never found."""
    alice, bob = two_teams

    def succeeded(client, name):
        job = h.wait_for(client, client.submit(h.spec(name, steps=2)).id, (job_pb2.SUCCEEDED,))
        for step in (1, 2):
            (Path(job.run_dir) / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        return job

    def starting_from(client, reference):
        spec = h.spec("next", steps=2)
        spec.trainer.checkpoint.path = reference
        return client.submit(spec)

    old = succeeded(alice, "base")
    new = succeeded(alice, "base")
    bobs = succeeded(bob, "base")
    job = starting_from(alice, "run:base")
    newest = f"{new.run_dir}/checkpoints/step_00000002"
    assert job.spec.trainer.checkpoint.path == newest != f"{old.run_dir}/checkpoints/step_00000002"
    (resolved,) = job.resolved
    assert (resolved.field, resolved.reference, resolved.job_id, resolved.path) == (
        "checkpoint.path", "run:base", new.id, newest,
    )  # fmt: skip
    assert alice.get(job.id).resolved[0].job_id == new.id  # stored with the job
    assert starting_from(bob, "run:base").resolved[0].job_id == bobs.id
    with pytest.raises(grpc.RpcError) as err:
        starting_from(bob, "run:next")  # alice's only, and not finished
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(
        "spec.trainer.checkpoint.path: run:next: no successful run named 'next'"
    )
