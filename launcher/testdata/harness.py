"""What the launcher's tests share: a launcher on 127.0.0.1 running the fake trainer."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import yaml
from google.protobuf import json_format

from launcher import health
from launcher.client import Client
from launcher.executors.base import read_json
from launcher.server import Launcher
from protos import job_pb2, launcher_pb2

FAKE_TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_trainer.py")
FINAL = (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED)


def config(tmp_path, nodes=1, **fields) -> launcher_pb2.LauncherConfig:
    """A launcher config for tests: ports chosen by the OS, fast polling, short grace."""
    behaviour = tmp_path / "behaviour"
    behaviour.mkdir(exist_ok=True)
    cfg = launcher_pb2.LauncherConfig(
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        state_dir=str(tmp_path / "state"),
        trainer_cmd=[sys.executable, FAKE_TRAINER, "--behaviour-dir", str(behaviour)],
        poll_interval_seconds=0.05,
        kill_grace_seconds=2,
        **fields,
    )
    if not cfg.pools:
        cfg.pools.add(name="cpu", nodes=nodes)
    # MLflow costs ~10 s of CPU per launcher (import, store tables): launcher/tracking/ tests it.
    cfg.tracking.uri = cfg.tracking.uri or "none"
    return cfg


def behave(tmp_path, name, **behaviour):
    """Tells the fake trainer how to (mis)behave for jobs named `name`."""
    (tmp_path / "behaviour" / f"{name}.json").write_text(json.dumps(behaviour))


def spec(name="tiny", steps=6, priority=0, **fields) -> job_pb2.JobSpec:
    s = job_pb2.JobSpec(name=name, kind=job_pb2.PRETRAIN, priority=priority, **fields)
    s.trainer.train.steps = steps
    s.retry.backoff_seconds = 0.2
    return s


def start(cfg) -> tuple[Launcher, Client]:
    launcher = Launcher(cfg).start()
    return launcher, Client(launcher.address)


@contextlib.contextmanager
def started(cfg) -> Iterator[tuple[Launcher, Client]]:
    """`start(cfg)`, then the client closed and the launcher stopped, whatever happens."""
    launcher, client = start(cfg)
    try:
        yield launcher, client
    finally:
        client.close()
        launcher.stop()


def wait_for(client, job_id, states, timeout=30.0) -> job_pb2.Job:
    """Polls GetJob until the job is in one of `states`; fails with the job's story if not."""
    deadline = time.monotonic() + timeout
    job = client.get(job_id)
    while job.state not in states:
        if time.monotonic() > deadline:
            names = [job_pb2.JobState.Name(s) for s in states]
            raise AssertionError(f"{job_id} not in {names} after {timeout} s: {job}")
        time.sleep(0.05)
        job = client.get(job_id)
    return job


def wait_for_step(client, job_id, step, timeout=30.0) -> job_pb2.Job:
    """Polls GetJob until the trainer has reported `step`."""
    deadline = time.monotonic() + timeout
    while (job := client.get(job_id)).progress.step < step:
        if time.monotonic() > deadline or job.state in FINAL:
            raise AssertionError(f"{job_id} never reported step {step}: {job}")
        time.sleep(0.05)
    return job


def wait_until(ready, what: str, timeout=30.0):
    """Polls `ready()` until it is true; fails naming `what` if it never is."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def steps_log(job) -> list[tuple[int, int]]:
    """(attempt, step) for every step the fake trainer ran for this job."""
    path = os.path.join(job.run_dir, "steps.log")
    with open(path) as f:
        pairs = (line.split() for line in f if line.strip())
        return [(int(attempt), int(step)) for attempt, step in pairs]


def written_json(path: str) -> dict:
    """A JSON file the launcher (or its attempt wrapper) has written by now; fails naming it if
    it is missing or not JSON."""
    data = read_json(path)
    if data is None:
        raise AssertionError(f"{path}: missing or not JSON")
    return data


def admin_tokens_file(tmp_path, token="admin-token") -> str:
    """A tokens file (auth on) with one admin, who may do everything."""
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens:\n  - {{token: {token}, user: ops, team: infra, admin: true}}\n")
    return str(path)


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def where_it_shows(secret: str, pids) -> list[str]:
    """ "PID cmdline" or "PID environ" for each process whose argv or environment holds it."""
    found = []
    for pid in pids:
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    if secret.encode() in f.read():
                        found.append(f"{pid} {part}")
            except OSError:
                continue  # gone meanwhile
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LauncherProcess:
    """`python -m launcher.server` in its own process, so that it can be killed with -9."""

    def __init__(self, tmp_path, cfg, env=None, name="launcher", listen=""):
        """`name` tells replicas apart: its config is NAME.yaml, its log NAME.log; `listen`
        its address (a free port by default)."""
        cfg.listen = listen or f"127.0.0.1:{free_port()}"  # the same port after a restart
        self.path = tmp_path / f"{name}.yaml"
        self.path.write_text(
            yaml.safe_dump(json_format.MessageToDict(cfg, preserving_proto_field_name=True))
        )
        self.address = cfg.listen
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.env = env or {}  # added to this process's environment
        self.proc: subprocess.Popen | None = None

    def start(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.server", "--config", str(self.path)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        client = Client(self.address)
        deadline = time.monotonic() + 30
        while True:
            try:
                if health.check(client.channel, timeout=1) == health.SERVING:
                    return client
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def kill9(self):
        assert self.proc is not None, "kill9 before start"
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()
