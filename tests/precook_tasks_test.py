"""A PRECOOK job with `data.tasks: 4` submitted to a real launcher runs as 4 tasks on its pool,
the real trainer in every step: on a Slurm pool (a real one-node Slurm started here) one
`sbatch --array`, on the local pool 4 local processes. The dataset is byte-identical to one
process's precook of the same config; a task that fails (a file in the way of its part) is
retried alone by the job's retry policy, and the result is still identical.
Under two launcher replicas on a real PostgreSQL (launcher/leader.py), the leader is killed
with -9 while the tasks run, on each pool: the other replica adopts the attempt (attempt 1
re-attached, not restarted: no task runs twice, none at once with itself), the array completes
on it, and the dataset is still byte-identical to one process's."""

import glob
import io
import os
import sys

import numpy as np
import pytest

from launcher import cli
from launcher.executors import task_array
from launcher.executors.base import attempt_dir
from launcher.executors.slurm_cluster import MISSING, POOL, one_node_cluster
from launcher.testdata import harness as h
from launcher.testdata.postgres import running_postgres
from launcher.testdata.replicas import leader, leading, replicas
from protos import job_pb2, launcher_pb2, trainer_config_pb2
from protos.validation import validate_job_spec
from trainer.data import tasks, testdata
from trainer.data.precook import precook_dataset
from trainer.data.progress import reporter

N_TASKS = 4
FILES, WORDS_PER_FILE = 40, 22_000  # ~5 MB in 1 MB units (corpus.UNIT_BYTES): 1-2 per task


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> trainer_config_pb2.DataConfig:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(21)
    for i in range(FILES):
        (root / f"doc-{i:03d}.txt").write_text(testdata.random_text(rng, WORDS_PER_FILE))
    return testdata.data_config(input=str(root), vocab_size=300, seq_len=128)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory) -> dict[str, bytes]:
    """The dataset precooked in one process: what every distributed run must equal."""
    ds = precook_dataset(data, str(tmp_path_factory.mktemp("one")), show_progress=False)
    return tree(ds.path)


def tree(path: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), path)] = f.read()
    return out


def spec(data) -> job_pb2.JobSpec:
    s = job_pb2.JobSpec(name="precook-four", kind=job_pb2.PRECOOK)
    s.trainer.data.CopyFrom(data)
    s.trainer.data.tasks = N_TASKS
    s.retry.backoff_seconds = 2  # time to take the fault away before the retry
    return s


def exit_codes(run_dir: str, attempt: int) -> dict[int, int]:
    tasks_dir = os.path.join(attempt_dir(run_dir, attempt), "tasks")
    return {
        int(i): h.written_json(os.path.join(tasks_dir, i, "exit.json"))["code"]
        for i in os.listdir(tasks_dir)
    }


def run_with_a_failing_task(cfg: launcher_pb2.LauncherConfig, data, one_process, tmp_path):
    """Submit the job with task 2 bound to fail once; returns the finished job."""
    cfg.ClearField("trainer_cmd")
    cfg.trainer_cmd.extend([sys.executable, "-m", "trainer.main"])
    job_spec = spec(data)
    cache = os.path.join(cfg.state_dir, "precook")
    # The job's directory, prepared as the job's own prepare step will find it again (the same
    # config, the same key): a file where task 2 renames its finished part fails that task.
    job = tasks.prepare(validate_job_spec(job_spec).data, cache, N_TASKS, reporter(False))
    assert all(len(job.units_of(i)) >= 1 for i in range(N_TASKS)), "every task must have work"
    blocker = job.part(2)
    with open(blocker, "w") as f:
        f.write("in the way")
    with h.started(cfg) as (launcher, client):
        submitted = client.submit(job_spec)
        h.wait_until(lambda: client.get(submitted.id).failures == 1, "a failure", timeout=90)
        failed_once = client.get(submitted.id)
        assert "precook task 2 of 4 exited 1" in failed_once.exit_reason, failed_once
        os.unlink(blocker)
        done = h.wait_for(client, submitted.id, h.FINAL, timeout=90)
        status = io.StringIO()
        assert cli.main(["--launcher", launcher.address, "status", done.id], out=status) == 0
    assert f"tasks       {N_TASKS}/{N_TASKS} done" in status.getvalue(), status.getvalue()
    assert done.state == job_pb2.SUCCEEDED, done
    assert done.attempts == 2 and done.failures == 1
    p = done.progress
    assert (p.precook_tasks_done, p.precook_tasks_total) == (N_TASKS, N_TASKS), p
    assert exit_codes(done.run_dir, 1) == {0: 0, 1: 0, 2: 1, 3: 0}
    assert exit_codes(done.run_dir, 2) == {2: 0}  # the retry ran the failed task alone
    ds = precook_dataset(validate_job_spec(job_spec).data, cache, show_progress=False)
    assert ds.cache_hit  # the job built it
    assert tree(ds.path) == one_process
    assert not os.path.exists(job.directory)  # the merge cleaned up
    return done


@pytest.fixture(autouse=True)
def absolute_pythonpath(monkeypatch):
    """Steps run in the job's run dir (Slurm: --chdir): the trainer's imports must not depend on
    the working directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(os.path.abspath(p) for p in sys.path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_local_pool_runs_four_processes_and_retries_a_failed_one_alone(data, one_process, tmp_path):
    cfg = h.config(tmp_path)
    run_with_a_failing_task(cfg, data, one_process, tmp_path)


@pytest.mark.skipif(bool(MISSING), reason=f"Slurm/munge binaries missing: {MISSING}")
def test_slurm_pool_runs_an_array_job_and_retries_a_failed_task_alone(data, one_process, tmp_path):
    cfg = h.config(tmp_path, pools=[POOL])
    with one_node_cluster():
        done = run_with_a_failing_task(cfg, data, one_process, tmp_path)
    second = attempt_dir(done.run_dir, 2)
    assert "SLURM_ARRAY_TASK_ID" in open(os.path.join(second, "task.sh")).read()


def run_through_a_failover(cfg: launcher_pb2.LauncherConfig, data, one_process, tmp_path):
    """Submit the job to two replicas, kill -9 the leader once a task runs; returns the job
    finished on the other replica."""
    cfg.ClearField("trainer_cmd")
    cfg.trainer_cmd.extend([sys.executable, "-m", "trainer.main"])
    job_spec = spec(data)
    with running_postgres() as pg:
        dsn = pg.create_database("precook")
        a, b = replicas(tmp_path, dsn, cfg=cfg)
        with leading(dsn, a, b) as (epoch, client):
            job = client.submit(job_spec)
            tasks_dir = os.path.join(attempt_dir(job.run_dir, 1), "tasks")

            def a_task_runs() -> bool:
                return bool(glob.glob(os.path.join(tasks_dir, "*", "pid.json")))

            h.wait_until(a_task_runs, "a task of the array starts", timeout=180)
            a.kill9()
            finished_before = len(task_array.succeeded(job.run_dir))
            assert finished_before < N_TASKS, "the array ended before the kill: nothing adopted"
            h.wait_until(lambda: leader(dsn) == (epoch + 1, b.address), "b takes over", 60)
            done = h.wait_for(client, job.id, h.FINAL, timeout=300)
            print(f"precook failover: {finished_before} of {N_TASKS} tasks done at the kill")
    assert (done.state, done.attempts, done.failures) == (job_pb2.SUCCEEDED, 1, 0), done
    assert exit_codes(done.run_dir, 1) == dict.fromkeys(range(N_TASKS), 0)  # each once
    assert f"re-attached {done.id} (RUNNING, attempt 1)" in b.log_path.read_text()
    cache = os.path.join(cfg.state_dir, "precook")
    ds = precook_dataset(validate_job_spec(job_spec).data, cache, show_progress=False)
    assert ds.cache_hit  # the job built it
    assert tree(ds.path) == one_process
    return done


def test_local_pool_array_completes_on_the_new_leader(data, one_process, tmp_path):
    run_through_a_failover(h.config(tmp_path), data, one_process, tmp_path)


@pytest.mark.skipif(bool(MISSING), reason=f"Slurm/munge binaries missing: {MISSING}")
def test_slurm_pool_array_completes_on_the_new_leader(data, one_process, tmp_path):
    cfg = h.config(tmp_path, pools=[POOL])
    with one_node_cluster():
        run_through_a_failover(cfg, data, one_process, tmp_path)
