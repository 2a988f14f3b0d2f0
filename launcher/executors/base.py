"""What every executor offers the launcher, and the files an attempt leaves in its run dir.

An attempt of job J lives in `<run_dir>/attempts/<N>/`: the launcher's handoff (`attempt.json`
and, with auth on, `token`; see launcher/handoff.py), `output.log` (stdout and stderr), and
for executors that use attempt_wrapper.py, `pid.json`, `exit.json` and `lock`. A handle is a
JSON object the launcher stores durably; it always has `attempt_dir` and `launched_at`, written
before anything is started, so an executor can find an attempt again after a launcher crash.
"""

import dataclasses
import enum
import fcntl
import json
import os
import sys

from launcher.executors.attempt_wrapper import write_json_atomically
from launcher.executors.handoff import ATTEMPT_FILE
from protos import attempt_pb2, job_pb2
from protos.attempt_file import OUTPUT_LOG
from protos.attempt_file import attempt_dir as attempt_dir  # re-exported: the executors use it

# What a trainer in an image or a pod gets of the launch environment (the host's PYTHONPATH
# is not for it).
PORTABLE_ENV = ("PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES")
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"  # a job's PATH on a host (job_env)
STARTUP_GRACE_SECONDS = 10.0  # an attempt launched this recently may not show up yet
WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attempt_wrapper.py")


class Status(enum.Enum):
    PENDING = "pending"  # accepted, not running yet (e.g. waiting in Slurm's queue)
    RUNNING = "running"
    EXITED = "exited"  # ended with an exit code
    LOST = "lost"  # gone without an exit code (killed with its wrapper, node lost, ...)
    NEVER_STARTED = "never_started"  # the launcher stopped before the attempt started


@dataclasses.dataclass(frozen=True)
class Observed:
    status: Status
    exit_code: int | None = None
    detail: str = ""
    tasks: tuple[int, int] | None = None  # a PRECOOK job's tasks (done, total): task_array.py


@dataclasses.dataclass(frozen=True)
class Launch:
    """Everything needed to start one attempt. Its handoff files are written already."""

    job: job_pb2.Job  # with attempts already counting this one
    attempt: attempt_pb2.Attempt  # what `<attempt_dir>/attempt.json` says
    trainer_cmd: list  # the host's trainer command (an image brings its own)
    env: dict  # extra environment for the trainer: no job facts, no secrets
    handle: dict  # {"attempt_dir", "launched_at"}; start() returns it extended

    @property
    def attempt_dir(self) -> str:
        return self.handle["attempt_dir"]

    @property
    def attempt_file(self) -> str:
        return os.path.join(self.attempt_dir, ATTEMPT_FILE)

    @property
    def log_path(self) -> str:
        return os.path.join(self.attempt_dir, OUTPUT_LOG)

    def trainer_args(self, attempt_file: str = "") -> list:
        """The trainer contract's arguments: `--attempt FILE` (where the trainer sees the
        handoff: its path on this machine unless the executor mounts it elsewhere)."""
        return ["--attempt", attempt_file or self.attempt_file]

    @property
    def argv(self) -> list:
        """The trainer command for one process (torchrun is the executor's business)."""
        return [*self.trainer_cmd, *self.trainer_args()]


class Executor:
    """Starts, watches and stops attempts. Methods are called from the launcher's loop only."""

    kind = "base"

    def start(self, launch: Launch) -> tuple[dict, Status]:
        """Starts the attempt; returns its handle and whether it is already running."""
        raise NotImplementedError

    def poll(self, handles: dict) -> dict:
        """{job_id: Observed} for {job_id: handle}; one call per loop for every attempt."""
        raise NotImplementedError

    def terminate(self, handle: dict):
        """Asks the attempt to stop (SIGTERM: the trainer checkpoints and exits 75)."""
        raise NotImplementedError

    def kill(self, handle: dict):
        """Stops the attempt now (SIGKILL)."""
        raise NotImplementedError


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wrapped(
    attempt_dir: str, argv: list, python: str = sys.executable, sandboxed: bool = False
) -> list:
    """`argv` under attempt_wrapper.py (`sandboxed`: argv is a bwrap command)."""
    flag = ["--sandboxed"] if sandboxed else []
    return [python, WRAPPER, "--attempt-dir", attempt_dir, *flag, "--", *argv]


def job_env(launch: Launch) -> dict:
    """A trainer's whole environment on a host: what the launch says and the basics a process
    needs, never the launcher's own (its KITCHEN_TOKEN, cloud credentials, ...). HOME is the
    run dir's `home/` (caches a library keeps there stay with the job)."""
    home = os.path.join(launch.job.run_dir, "home")
    os.makedirs(home, exist_ok=True)
    return {"PATH": JOB_PATH, "HOME": home, "LANG": "C.UTF-8", "TMPDIR": "/tmp", **launch.env}


def torchrun(torchrun_cmd: list, argv: list, nproc: int, rendezvous: list) -> list:
    """`argv` under torchrun, which starts `nproc` copies per node (`--no-python`: argv[0] is
    the program itself, so both `python3 -m trainer.main` and a Bazel binary work)."""
    return [*torchrun_cmd, *rendezvous, f"--nproc-per-node={nproc}", "--no-python", *argv]


def last_line(path: str, limit: int = 200) -> str:
    """The last non-empty line of a log (what a person wants in a failure reason)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    return lines[-1][:limit] if lines else ""


def exit_status(attempt_dir: str) -> "Observed | None":
    """How the attempt ended, from the wrapper's exit.json (None: not ended, or no wrapper)."""
    ended = read_json(os.path.join(attempt_dir, "exit.json"))
    if ended is None:
        return None
    if ended.get("abandoned"):
        return Observed(Status.NEVER_STARTED, detail="the launcher stopped while starting it")
    return Observed(Status.EXITED, ended["code"], ended.get("error", ""))


def abandon(attempt_dir: str, now: float) -> Observed:
    """Gives up on an attempt that never started: writes exit.json (so a wrapper that starts
    late does nothing), unless a wrapper holds the attempt's lock (then it is starting)."""
    os.makedirs(attempt_dir, exist_ok=True)
    with open(os.path.join(attempt_dir, "lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Observed(Status.PENDING)
        ended = exit_status(attempt_dir)
        if ended is not None:
            return ended
        write_json_atomically(
            os.path.join(attempt_dir, "exit.json"), {"abandoned": True, "finished": now}
        )
    return Observed(Status.NEVER_STARTED, detail="the launcher stopped while starting it")
