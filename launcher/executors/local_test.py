"""The local executor with real processes: exit codes, signals, process trees, re-attaching."""

import os
import signal
import subprocess
import sys
import time

from launcher.executors.attempt_wrapper import DUPLICATE, start_ticks
from launcher.executors.base import Launch, Status, attempt_dir, read_json, wrapped
from launcher.executors.local import LocalExecutor
from protos import attempt_pb2, job_pb2

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def launch_of(tmp_path, code: str, attempt=1, processes=1, now=None) -> Launch:
    job = job_pb2.Job(id="j1", attempts=attempt, run_dir=str(tmp_path))
    job.spec.resources.processes_per_node = processes
    handle = {"attempt_dir": attempt_dir(str(tmp_path), attempt), "launched_at": now or time.time()}
    handoff = attempt_pb2.Attempt(job_id="j1", number=attempt, run_dir=str(tmp_path))
    # `python -c CODE --attempt FILE`: the contract's arguments land in sys.argv, unread.
    return Launch(job, handoff, [sys.executable, "-c", code], {"KITCHEN_TEST": "yes"}, handle)


def wait_status(executor, handle, statuses, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        seen = executor.poll({"j1": handle})["j1"]
        if seen.status in statuses or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def test_exit_code_env_and_log(tmp_path):
    ex = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, "import os; print('env', os.environ['KITCHEN_TEST']); exit(3)")
    handle, status = ex.start(launch)
    assert status == Status.RUNNING
    seen = wait_status(ex, handle, {Status.EXITED})
    assert (seen.status, seen.exit_code) == (Status.EXITED, 3)
    with open(launch.log_path) as f:
        assert f.read() == "env yes\n"


def test_sigterm_reaches_the_trainer_once_and_its_exit_code_is_kept(tmp_path):
    code = (
        "import signal, sys, time\n"
        "hits = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: hits.append(1))\n"
        "print('ready', flush=True)\n"
        "while not hits: time.sleep(0.01)\n"
        "time.sleep(0.2)\n"
        "print('terms', len(hits), flush=True); sys.exit(75)\n"
    )
    ex = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, code)
    handle, _ = ex.start(launch)
    assert wait_status(ex, handle, {Status.RUNNING}).status == Status.RUNNING
    _wait_for_text(launch.log_path, "ready")
    ex.terminate(handle)
    seen = wait_status(ex, handle, {Status.EXITED})
    assert seen.exit_code == 75
    assert "terms 1" in open(launch.log_path).read()


def test_kill_ends_the_whole_tree(tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('grandchild', child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    ex = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, code)
    handle, _ = ex.start(launch)
    grandchild = int(_wait_for_text(launch.log_path, "grandchild").split()[1])
    ex.kill(handle)
    seen = wait_status(ex, handle, {Status.EXITED})
    assert seen.exit_code == 128 + signal.SIGKILL
    deadline = time.monotonic() + 5
    while start_ticks(grandchild) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert start_ticks(grandchild) is None, "the trainer's own child survived the kill"


def test_reattach_after_launcher_restart(tmp_path):
    code = "import time; time.sleep(1.0); exit(0)"
    first = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, code)
    handle, _ = first.start(launch)
    assert wait_status(first, handle, {Status.RUNNING}).status == Status.RUNNING
    restarted = LocalExecutor(TORCHRUN)  # knows nothing but the stored handle
    assert restarted.poll({"j1": handle})["j1"].status == Status.RUNNING
    seen = wait_status(restarted, handle, {Status.EXITED})
    assert (seen.status, seen.exit_code) == (Status.EXITED, 0)


def test_a_dead_wrapper_without_exit_code_is_lost(tmp_path):
    ex = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, "import time; time.sleep(600)")
    handle, _ = ex.start(launch)
    wait_status(ex, handle, {Status.RUNNING})
    pids = _wait_for_pids(launch.attempt_dir)
    os.kill(pids["pid"], signal.SIGKILL)  # the wrapper, not the trainer
    seen = wait_status(LocalExecutor(TORCHRUN), handle, {Status.LOST})
    assert seen.status == Status.LOST and "died" in seen.detail
    ex.kill(handle)  # the orphaned trainer's group is still ours to end
    deadline = time.monotonic() + 5
    while start_ticks(pids["child_pgid"]) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert start_ticks(pids["child_pgid"]) is None


def test_never_started_attempt_is_abandoned_and_a_late_wrapper_does_nothing(tmp_path):
    clock = [1000.0]
    ex = LocalExecutor(TORCHRUN, clock=lambda: clock[0])
    launch = launch_of(tmp_path, "print('ran'); open('ran', 'w')", now=1000.0)
    # The launcher stored STARTING, then died before starting the wrapper.
    assert ex.poll({"j1": launch.handle})["j1"].status == Status.PENDING
    clock[0] += 60
    assert ex.poll({"j1": launch.handle})["j1"].status == Status.NEVER_STARTED
    late = subprocess.run(wrapped(launch.attempt_dir, launch.argv), cwd=tmp_path)
    assert late.returncode == DUPLICATE
    assert not (tmp_path / "ran").exists()


def test_a_second_wrapper_for_a_live_attempt_refuses_to_run(tmp_path):
    ex = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, "import time; time.sleep(600)")
    handle, _ = ex.start(launch)
    _wait_for_pids(launch.attempt_dir)
    twin = subprocess.run(wrapped(launch.attempt_dir, [sys.executable, "-c", "print('twin')"]))
    assert twin.returncode == DUPLICATE
    ex.kill(handle)
    assert wait_status(ex, handle, {Status.EXITED}).exit_code == 137


def test_several_processes_run_under_torchrun(tmp_path):
    code = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    ex = LocalExecutor(TORCHRUN)
    launch = launch_of(tmp_path, code, processes=2)
    handle, _ = ex.start(launch)
    seen = wait_status(ex, handle, {Status.EXITED}, timeout=60)
    log = open(launch.log_path).read()
    assert seen.exit_code == 0, log
    assert "rank 0 of 2" in log and "rank 1 of 2" in log


def _wait_for_text(path, text, timeout=20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            for line in open(path):
                if text in line:
                    return line
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def _wait_for_pids(d, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while (pids := read_json(os.path.join(d, "pid.json"))) is None:
        assert time.monotonic() < deadline, "pid.json never appeared"
        time.sleep(0.05)
    return pids
