"""The Slurm executor against a real one-node Slurm (munged, slurmctld, slurmd on 127.0.0.1)
that this test starts in a temporary directory and stops afterwards."""

import os
import sys
import time

import pytest

from launcher.executors.base import Launch, Status, attempt_dir
from launcher.executors.slurm import SlurmExecutor
from launcher.executors.slurm_cluster import MISSING, POOL, one_node_cluster
from launcher.executors.slurm_cluster import wait_until as _wait
from launcher.testdata import harness as h
from protos import attempt_pb2, job_pb2, launcher_pb2

pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"Slurm/munge binaries missing: {MISSING}")


@pytest.fixture(scope="module")
def slurm():
    with one_node_cluster() as root:
        yield root


def _launch(tmp_path, code, attempt=1):
    job = job_pb2.Job(id="j5", attempts=attempt, run_dir=str(tmp_path))
    handle = {"attempt_dir": attempt_dir(str(tmp_path), attempt), "launched_at": time.time()}
    handoff = attempt_pb2.Attempt(job_id="j5", number=attempt, run_dir=str(tmp_path))
    env = {"KITCHEN_TEST": "from-launcher"}
    return Launch(job, handoff, [sys.executable, "-c", code], env, handle)


def _read_if_exists(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _wait_status(ex, handle, statuses, timeout=60.0):
    deadline = time.monotonic() + timeout
    while (seen := ex.poll({"j": handle})["j"]).status not in statuses:
        assert time.monotonic() < deadline, f"still {seen} after {timeout} s"
        time.sleep(0.2)
    return seen


def test_exit_code_env_and_log_through_slurm(slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("KITCHEN_TOKEN", "the-launchers-own")  # sbatch must not pass it on
    ex = SlurmExecutor(launcher_pb2.SlurmPoolConfig(), [])
    code = "import os; print('env', os.environ['KITCHEN_TEST'], 'KITCHEN_TOKEN' in os.environ)"
    launch = _launch(tmp_path, code + "; exit(3)")
    handle, status = ex.start(launch)
    assert status == Status.PENDING and handle["slurm_job_id"].isdigit()
    seen = _wait_status(ex, handle, {Status.EXITED, Status.LOST})
    assert (seen.status, seen.exit_code) == (Status.EXITED, 3)
    assert "env from-launcher False" in open(launch.log_path).read()


def test_sigterm_via_scancel_and_finding_a_job_by_name(slurm, tmp_path):
    code = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    print('checkpointing', flush=True)\n"
        "    sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    ex = SlurmExecutor(launcher_pb2.SlurmPoolConfig(), [])
    launch = _launch(tmp_path, code)
    handle, _ = ex.start(launch)
    _wait_status(ex, handle, {Status.RUNNING})
    # A launcher that crashed right after sbatch stored only the name: it finds the job.
    by_name = {k: v for k, v in handle.items() if k != "slurm_job_id"}
    assert ex.poll({"j": by_name})["j"].status == Status.RUNNING
    # Slurm says RUNNING before the batch script has created the log: wait for both.
    _wait(lambda: "ready" in _read_if_exists(launch.log_path), "trainer ready", slurm)
    ex.terminate(by_name)
    seen = _wait_status(ex, handle, {Status.EXITED, Status.LOST})
    assert (seen.status, seen.exit_code) == (Status.EXITED, 75)
    assert "checkpointing" in open(launch.log_path).read()


def test_launcher_with_a_slurm_pool(slurm, tmp_path):
    cfg = h.config(tmp_path, pools=[POOL])
    with h.started(cfg) as (launcher, client):
        job = client.submit(h.spec("via-slurm", steps=4))
        done = h.wait_for(client, job.id, h.FINAL, timeout=90)
        assert done.state == job_pb2.SUCCEEDED, done
        assert done.progress.step == 4  # the trainer on the "node" reported to the launcher
        assert done.handle == "" and h.steps_log(done) == [(1, 1), (1, 2), (1, 3), (1, 4)]

        h.behave(tmp_path, "long", steps=10_000, step_seconds=0.05)
        long = client.submit(h.spec("long"))
        h.wait_for_step(client, long.id, 2, timeout=90)
        client.cancel(long.id)
        assert h.wait_for(client, long.id, h.FINAL, timeout=60).state == job_pb2.CANCELLED


def test_a_job_in_an_image_through_slurm(slurm, tmp_path):
    layout = os.path.abspath(
        os.environ.get("LAUNCHER_LAYOUT")
        or os.path.join(os.path.dirname(h.FAKE_TRAINER), "../../.bazel/bin/images/launcher.oci")
    )
    if not os.path.isfile(os.path.join(layout, "index.json")):
        pytest.skip(f"{layout} is not built (bazel build //images:launcher)")
    cfg = h.config(tmp_path, pools=[POOL])
    fake_trainer, behaviour = os.path.realpath(h.FAKE_TRAINER), str(tmp_path / "behaviour")
    cfg.images.entrypoint = f"python3 {fake_trainer} --behaviour-dir {behaviour}"
    cfg.images.binds.extend([os.path.dirname(fake_trainer), behaviour])
    with h.started(cfg) as (launcher, client):
        job = client.submit(h.spec("boxed", steps=3, image=layout))
        done = h.wait_for(client, job.id, h.FINAL, timeout=120)
        batch = open(os.path.join(attempt_dir(done.run_dir, 1), "batch.sh")).read()
        assert done.state == job_pb2.SUCCEEDED, (done, batch)
        assert "run_image" in batch and f"--layout {layout}" in batch
        assert done.progress.step == 3 and h.steps_log(done) == [(1, 1), (1, 2), (1, 3)]
