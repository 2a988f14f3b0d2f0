"""A PRECOOK job's steps (task_array.py) on the local executor and on a real one-node Slurm
(started here), with a stand-in trainer whose task steps run until stopped: cancelling the
attempt stops every task and leaves nothing queued. The real trainer's steps are
tests/precook_tasks_test.py."""

import json
import os
import subprocess
import sys
import time
from unittest.mock import ANY

import pytest

from launcher.executors import task_array
from launcher.executors.attempt_wrapper import start_ticks
from launcher.executors.base import Launch, Observed, Status, attempt_dir, read_json
from launcher.executors.local import LocalExecutor
from launcher.executors.slurm import PENDING_STATES, RUNNING_STATES, SlurmExecutor
from launcher.executors.slurm_cluster import MISSING, one_node_cluster
from protos import attempt_pb2, job_pb2, launcher_pb2
from protos.precook_steps import PrecookStep

# prepare and merge end at once; a task runs until it is stopped.
STAND_IN = "import sys, time; time.sleep(600 if 'task' in sys.argv else 0)"


def launch(tmp_path, n_tasks=4, attempt=1) -> Launch:
    job = job_pb2.Job(id="j7", attempts=attempt, run_dir=str(tmp_path))
    job.spec.kind = job_pb2.PRECOOK
    job.spec.trainer.data.tasks = n_tasks
    handle = {"attempt_dir": attempt_dir(str(tmp_path), attempt), "launched_at": time.time()}
    handoff = attempt_pb2.Attempt(job_id="j7", number=attempt, run_dir=str(tmp_path))
    return Launch(job, handoff, [sys.executable, "-c", STAND_IN], {}, handle)


def wait_for(ex, handle, done, what, timeout=60.0) -> Observed:
    deadline = time.monotonic() + timeout
    while not done(seen := ex.poll({"j": handle})["j"]):
        assert time.monotonic() < deadline, f"{what}: still {seen} after {timeout} s"
        time.sleep(0.2)
    return seen


def task_pids(d: str) -> dict[int, dict]:
    """{task: pid.json} of the tasks whose wrapper has started."""
    out = {}
    for i in range(4):
        pids = read_json(os.path.join(task_array.step_dir(d, PrecookStep.TASK, i), "pid.json"))
        if pids is not None:
            out[i] = pids
    return out


def assert_gone(running: dict[int, dict], timeout: float = 30.0):
    """Every task's trainer ended. A SIGKILL takes effect when its process next runs, so on a
    loaded machine a trainer can outlive, by a moment, the wrapper whose end was seen."""
    deadline = time.monotonic() + timeout
    alive = running
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {
            task: pids
            for task, pids in alive.items()
            if start_ticks(pids["child_pgid"]) == pids["child_start_ticks"]
        }
    assert not alive, f"task trainers still running {timeout} s after the attempt ended: {alive}"


def test_todo_skips_the_tasks_that_succeeded_in_earlier_attempts(tmp_path):
    run_dir = str(tmp_path)
    for attempt, task, code in ((1, 0, 0), (1, 1, 1), (2, 1, 0), (2, 2, 137)):
        d = task_array.step_dir(attempt_dir(run_dir, attempt), PrecookStep.TASK, task)
        os.makedirs(d)
        with open(os.path.join(d, "exit.json"), "w") as f:
            json.dump({"code": code}, f)
    assert task_array.todo(run_dir, 4) == [2, 3]
    failed = task_array.failed_step(attempt_dir(run_dir, 2), range(4), 4)
    assert failed is not None and failed.exit_code == 137
    assert failed.detail.startswith("precook task 2 of 4 exited 137")
    assert task_array.n_tasks(launch(tmp_path).job) == 4
    boxed = launch(tmp_path).job
    boxed.spec.image = "registry/precook:1"  # in an image: its own local processes
    assert task_array.n_tasks(boxed) == 1


def test_local_cancel_stops_every_running_task_and_starts_no_more(tmp_path):
    ex = LocalExecutor([])
    job = launch(tmp_path)
    handle, status = ex.start(job)
    assert status == Status.RUNNING and handle["precook_tasks"] == 4
    parallel = min(4, os.cpu_count() or 1)
    seen = wait_for(ex, handle, lambda s: len(task_pids(job.attempt_dir)) == parallel, "tasks")
    assert seen.status == Status.RUNNING and seen.tasks == (0, 4)
    running = task_pids(job.attempt_dir)
    ex.terminate(handle)
    seen = wait_for(ex, handle, lambda s: s.status == Status.EXITED, "the attempt's end")
    assert seen.exit_code == 128 + 15 and "precook task 0 of 4 exited 143" in seen.detail
    assert_gone(running)  # every trainer got the SIGTERM
    assert set(task_pids(job.attempt_dir)) == set(running)  # nothing started after it


def test_local_kill_reaches_every_task_trainer_in_its_own_group(tmp_path):
    ex = LocalExecutor([])
    job = launch(tmp_path)
    handle, _ = ex.start(job)
    parallel = min(4, os.cpu_count() or 1)
    wait_for(ex, handle, lambda s: len(task_pids(job.attempt_dir)) == parallel, "tasks")
    running = task_pids(job.attempt_dir)
    ex.kill(handle)  # SIGKILL: no wrapper forwards anything
    seen = wait_for(ex, handle, lambda s: s.status == Status.EXITED, "the attempt's end")
    assert seen.exit_code == 128 + 9
    assert_gone(running)


@pytest.mark.skipif(bool(MISSING), reason=f"Slurm/munge binaries missing: {MISSING}")
def test_slurm_runs_one_array_job_an_element_fails_alone_and_cancel_ends_it_all(tmp_path):
    ex = SlurmExecutor(launcher_pb2.SlurmPoolConfig(), [])
    with one_node_cluster() as root:
        job = launch(tmp_path)
        handle, status = ex.start(job)
        assert status == Status.PENDING and len(handle["slurm_job_ids"]) == 3
        array = handle["slurm_job_ids"][1]
        seen = wait_for(ex, handle, lambda s: bool(task_pids(job.attempt_dir)), "a task")
        assert seen.status == Status.RUNNING and seen.tasks == (0, 4)
        queue = squeue(handle)
        assert {str(j["array_job_id"]) for j in queue if j["name"].endswith("-task")} == {array}
        first = min(task_pids(job.attempt_dir))
        subprocess.run(["scancel", f"{array}_{first}"], check=True)  # one element only
        ended = task_array.step_dir(job.attempt_dir, PrecookStep.TASK, first)
        wait_for(ex, handle, lambda s: read_json(os.path.join(ended, "exit.json")) is not None,
                 "the cancelled task's exit code")  # fmt: skip
        seen = ex.poll({"j": handle})["j"]  # its failure is recorded; the others still run
        assert seen.status == Status.RUNNING
        assert read_json(f"{ended}/exit.json") == {"code": 143, "finished": ANY}
        ex.terminate(handle)
        seen = wait_for(ex, handle, lambda s: s.status not in (Status.PENDING, Status.RUNNING),
                        "the attempt's end")  # fmt: skip
        assert seen.status == Status.EXITED and seen.exit_code == 143, (seen, root)
        # The attempt's end names the lowest-index failed task (task_array.failed_step): the
        # one cancelled alone, or a lower one the cancel of the whole array ended before it
        # started (on a loaded machine task 0 may not have been running yet).
        failed = [
            i
            for i in range(4)
            if (read_json(f"{task_array.step_dir(job.attempt_dir, PrecookStep.TASK, i)}/exit.json")
                or {}).get("code", 0) != 0
        ]  # fmt: skip
        assert first in failed
        assert seen.detail.startswith(f"precook task {min(failed)} of 4 exited 143")
        assert squeue(handle) == []  # prepare done; array and merge cancelled


def squeue(handle: dict) -> list[dict]:
    names = ",".join(f"{handle['name']}-{s.value}" for s in PrecookStep)
    out = subprocess.run(
        ["squeue", "--json", f"--name={names}"], capture_output=True, text=True, check=True
    )
    active = RUNNING_STATES | PENDING_STATES
    return [j for j in json.loads(out.stdout)["jobs"] if j["job_state"] in active]
