"""The Slurm executor against a real one-node Slurm (munged, slurmctld, slurmd on 127.0.0.1)
that this test starts in a temporary directory and stops afterwards."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from launcher.executors.base import Launch, Status, attempt_dir
from launcher.executors.slurm import SlurmExecutor
from launcher.testdata import harness as h
from protos import attempt_pb2, job_pb2, launcher_pb2

DAEMONS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol"]
MISSING = [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"Slurm/munge binaries missing: {MISSING}")


def _binary(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=kitchentest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
KillWait=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm():
    # A short path under /tmp: munge's unix socket path must stay under 108 bytes.
    root = tempfile.mkdtemp(prefix="kslurm-", dir="/tmp")
    os.chmod(root, 0o755)  # munged insists that everyone may traverse to its socket
    for d, mode in (("munge", 0o755), ("munge-key", 0o700), ("state", 0o755), ("spool", 0o755)):
        os.makedirs(f"{root}/{d}")
        os.chmod(f"{root}/{d}", mode)
    host = socket.gethostname().split(".")[0]
    conf = f"{root}/slurm.conf"
    with open(conf, "w") as f:
        f.write(
            SLURM_CONF.format(host=host, root=root, ctld_port=_free_port(), d_port=_free_port())
        )
    subprocess.run(
        [_binary("mungekey"), "--create", f"--keyfile={root}/munge-key/munge.key"], check=True
    )
    log = open(f"{root}/daemons.log", "ab")  # noqa: SIM115
    daemons = [
        subprocess.Popen(
            [_binary("munged"), "-F", f"--socket={root}/munge/munge.socket",
             f"--key-file={root}/munge-key/munge.key", f"--pid-file={root}/munged.pid",
             f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
            stdout=log, stderr=log,
        )
    ]  # fmt: skip
    _wait(lambda: os.path.exists(f"{root}/munge/munge.socket"), "munged", root, daemons)
    daemons.append(
        subprocess.Popen([_binary("slurmctld"), "-D", "-f", conf], stdout=log, stderr=log)
    )
    daemons.append(
        subprocess.Popen([_binary("slurmd"), "-D", "-f", conf, "-N", host], stdout=log, stderr=log)
    )
    env = {**os.environ, "SLURM_CONF": conf}
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # sbatch/squeue/scancel run by the executor read it
    try:
        _wait(lambda: _sinfo(env) == "idle", "slurmd idle", root, daemons)
        yield root
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        for p in reversed(daemons):
            p.send_signal(signal.SIGTERM)
        for p in reversed(daemons):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        if old is None:
            os.environ.pop("SLURM_CONF")
        else:
            os.environ["SLURM_CONF"] = old
        shutil.rmtree(root, ignore_errors=True)


def _sinfo(env):
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def _wait(ready, what, root, daemons=(), timeout=30.0):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
            logs = {
                n: open(f"{root}/{n}").read()[-2000:]
                for n in os.listdir(root)
                if n.endswith(".log")
            }
            raise AssertionError(f"{what} not ready (or a daemon died): {logs}")
        time.sleep(0.2)


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


def test_exit_code_env_and_log_through_slurm(slurm, tmp_path):
    ex = SlurmExecutor(launcher_pb2.SlurmPoolConfig(), [])
    launch = _launch(tmp_path, "import os; print('env', os.environ['KITCHEN_TEST']); exit(3)")
    handle, status = ex.start(launch)
    assert status == Status.PENDING and handle["slurm_job_id"].isdigit()
    seen = _wait_status(ex, handle, {Status.EXITED, Status.LOST})
    assert (seen.status, seen.exit_code) == (Status.EXITED, 3)
    assert "env from-launcher" in open(launch.log_path).read()


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
    cfg = h.config(tmp_path)
    del cfg.pools[:]
    cfg.pools.add(name="slurm", executor=launcher_pb2.SLURM, nodes=1)
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


def test_a_job_in_an_image_through_slurm(slurm, tmp_path, monkeypatch):
    layout = os.path.abspath(
        os.environ.get("LAUNCHER_LAYOUT")
        or os.path.join(os.path.dirname(h.FAKE_TRAINER), "../../.bazel/bin/images/launcher.oci")
    )
    if not os.path.isfile(os.path.join(layout, "index.json")):
        pytest.skip(f"{layout} is not built (bazel build //images:launcher)")
    monkeypatch.setenv("KITCHEN_CACHE_DIR", str(tmp_path / "cache"))  # sbatch passes it on
    cfg = h.config(tmp_path)
    del cfg.pools[:]
    cfg.pools.add(name="slurm", executor=launcher_pb2.SLURM, nodes=1)
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
