"""The SQLite job store, on real files."""

import threading

import pytest

from launcher.store import JobStore, PageTokenError
from protos import job_pb2


def new_job(name="tiny", team="nlp", state=job_pb2.QUEUED, pool="cpu"):
    job = job_pb2.Job(state=state, pool=pool)
    job.spec.name, job.spec.team, job.spec.owner = name, team, "alice"
    return job


def test_insert_get_update_survive_reopening(tmp_path):
    path = str(tmp_path / "jobs.sqlite")
    store = JobStore(path)
    job, created = store.insert(new_job(), on_id=lambda j: setattr(j, "run_dir", f"/runs/{j.id}"))
    assert created and job.id == "j1" and job.run_dir == "/runs/j1"
    job.state = job_pb2.RUNNING
    store.update(job, attempt_token="tok")
    store.close()
    again = JobStore(path)
    assert again.get("j1").state == job_pb2.RUNNING
    assert again.get("j1").run_dir == "/runs/j1"
    assert again.attempt_token("j1") == "tok"
    assert again.get("j9") is None and again.get("nonsense") is None


def test_request_id_makes_submit_idempotent(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    first, created = store.insert(new_job(), request_id="r-1")
    second, created_again = store.insert(new_job(name="other"), request_id="r-1")
    assert created and not created_again
    assert second.id == first.id and second.spec.name == "tiny"
    assert store.page()[0] == [first]


def test_pages_newest_first_with_filters(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    for i in range(25):
        state = job_pb2.SUCCEEDED if i % 5 == 0 else job_pb2.QUEUED
        store.insert(new_job(name=f"n{i}", team="nlp" if i % 2 else "vision", state=state))
    ids, token = [], ""
    while True:
        jobs, token = store.page(page_size=10, page_token=token)
        ids += [j.id for j in jobs]
        if not token:
            break
    assert ids == [f"j{i}" for i in range(25, 0, -1)]
    done, _ = store.page(states=[job_pb2.SUCCEEDED])
    assert [j.id for j in done] == ["j21", "j16", "j11", "j6", "j1"]
    nlp_done, _ = store.page(states=[job_pb2.SUCCEEDED], team="nlp")
    assert [j.spec.name for j in nlp_done] == ["n15", "n5"]
    assert len(store.unfinished()) == 20
    assert store.counts() == {(job_pb2.SUCCEEDED, "cpu"): 5, (job_pb2.QUEUED, "cpu"): 20}
    with pytest.raises(PageTokenError, match="page_token"):
        store.page(page_token="garbage")


def test_concurrent_writers_lose_nothing(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite"))
    errors = []

    def submit(worker):
        try:
            for i in range(25):
                store.insert(new_job(name=f"w{worker}-{i}"), request_id=f"{worker}-{i}")
        except Exception as e:  # collected: a failure in a thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=submit, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    jobs, _ = store.page(page_size=1000)
    assert len({j.id for j in jobs}) == len({j.spec.name for j in jobs}) == 200
