"""A real one-node Slurm (munged, slurmctld, slurmd on 127.0.0.1) for tests: started in a
temporary directory, stopped afterwards. Used by slurm_test and by distributed precook's test
(trainer/data/tasks_test.py)."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from protos import launcher_pb2

DAEMONS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol"]
MISSING = [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]
# The launcher's pool of that one node (LauncherConfig.pools).
POOL = launcher_pb2.PoolConfig(name="slurm", executor=launcher_pb2.SLURM, nodes=1)


def binary(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def free_port():
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
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def one_node_cluster():
    """Start the cluster; yields its directory, with SLURM_CONF set for sbatch and squeue."""
    # A short path under /tmp: munge's unix socket path must stay under 108 bytes.
    root = tempfile.mkdtemp(prefix="kslurm-", dir="/tmp")
    os.chmod(root, 0o755)  # munged insists that everyone may traverse to its socket
    for d, mode in (("munge", 0o755), ("munge-key", 0o700), ("state", 0o755), ("spool", 0o755)):
        os.makedirs(f"{root}/{d}")
        os.chmod(f"{root}/{d}", mode)
    host = socket.gethostname().split(".")[0]
    conf = f"{root}/slurm.conf"
    with open(conf, "w") as f:
        f.write(SLURM_CONF.format(host=host, root=root, ctld_port=free_port(), d_port=free_port()))
    subprocess.run(
        [binary("mungekey"), "--create", f"--keyfile={root}/munge-key/munge.key"], check=True
    )
    log = open(f"{root}/daemons.log", "ab")  # noqa: SIM115
    daemons = [
        subprocess.Popen(
            [binary("munged"), "-F", f"--socket={root}/munge/munge.socket",
             f"--key-file={root}/munge-key/munge.key", f"--pid-file={root}/munged.pid",
             f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
            stdout=log, stderr=log,
        )
    ]  # fmt: skip
    wait_until(lambda: os.path.exists(f"{root}/munge/munge.socket"), "munged", root, daemons)
    daemons.append(
        subprocess.Popen([binary("slurmctld"), "-D", "-f", conf], stdout=log, stderr=log)
    )
    daemons.append(
        subprocess.Popen([binary("slurmd"), "-D", "-f", conf, "-N", host], stdout=log, stderr=log)
    )
    env = {**os.environ, "SLURM_CONF": conf}
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # sbatch/squeue/scancel run by the executor read it
    try:
        wait_until(lambda: sinfo(env) == "idle", "slurmd idle", root, daemons)
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


def sinfo(env):
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def wait_until(ready, what, root, daemons=(), timeout=30.0):
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
