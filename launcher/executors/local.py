"""Runs attempts as subprocesses of this machine.

Each attempt is `attempt_wrapper.py` in its own session, with the trainer in its own process
group below it (cancel ends the whole tree: torchrun, its workers, data loader workers). Output
goes to `<attempt_dir>/output.log`. The wrapper records pid and exit code in the attempt dir,
so after a launcher restart an attempt is found again by pid + start time, and one that ended
while the launcher was down still tells its exit code.
"""

import os
import signal
import subprocess
import time

from launcher.executors import image
from launcher.executors.attempt_wrapper import DUPLICATE, start_ticks
from launcher.executors.base import (
    STARTUP_GRACE_SECONDS,
    Executor,
    Launch,
    Observed,
    Status,
    abandon,
    exit_status,
    read_json,
    torchrun,
    wrapped,
)


class LocalExecutor(Executor):
    kind = "local"

    def __init__(self, torchrun_cmd: list, clock=time.time, images=None):
        self.torchrun_cmd = torchrun_cmd
        self.clock = clock
        self.images = images  # kitchen.v1.ImageRunConfig, resolved: for jobs naming an image
        # attempt_dir -> Popen of the wrappers this process started
        self._children: dict[str, subprocess.Popen] = {}

    def start(self, launch: Launch):
        resources = launch.job.spec.resources
        env = {**os.environ, **launch.env}
        gpus = [g for node in launch.job.allocation for g in node.gpus]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        argv = launch.argv
        nproc = resources.processes_per_node or 1
        if launch.job.spec.image:  # one node; torchrun inside the image for several processes
            argv = image.command(self.images, launch, env, ",".join(map(str, gpus)))
        elif nproc > 1:
            argv = torchrun(self.torchrun_cmd, argv, nproc, ["--standalone", "--nnodes=1"])
        os.makedirs(launch.attempt_dir, exist_ok=True)
        with open(launch.log_path, "ab") as log:
            popen = subprocess.Popen(
                wrapped(launch.attempt_dir, argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not killed by a Ctrl-C meant for the launcher
                env=env,
                cwd=launch.job.run_dir,
            )
        self._children[launch.attempt_dir] = popen
        return {**launch.handle, "wrapper_pid": popen.pid}, Status.RUNNING

    def poll(self, handles: dict) -> dict:
        return {job_id: self._poll_one(h) for job_id, h in handles.items()}

    def _poll_one(self, handle: dict) -> Observed:
        d = handle["attempt_dir"]
        child = self._children.get(d)
        if child is not None:
            child.poll()  # reap the wrapper if it ended
        ended = exit_status(d)
        if ended is not None:
            self._children.pop(d, None)
            return ended
        pids = read_json(os.path.join(d, "pid.json"))
        if pids is not None:
            if start_ticks(pids["pid"]) == pids["start_ticks"]:
                return Observed(Status.RUNNING)
            ended = exit_status(d)  # it may have just finished
            if ended is not None:
                return ended
            self._children.pop(d, None)
            return Observed(Status.LOST, detail=f"wrapper pid {pids['pid']} died unrecorded")
        if child is not None:
            if child.returncode is None or child.returncode == DUPLICATE:
                return Observed(Status.PENDING)
            self._children.pop(d, None)
            return Observed(Status.LOST, detail=f"wrapper exited {child.returncode} at start")
        if self.clock() - handle["launched_at"] < STARTUP_GRACE_SECONDS:
            return Observed(Status.PENDING)
        return abandon(d, self.clock())

    def terminate(self, handle: dict):
        self._signal(handle, signal.SIGTERM)

    def kill(self, handle: dict):
        self._signal(handle, signal.SIGKILL)

    def _signal(self, handle: dict, sig: int):
        d = handle["attempt_dir"]
        pids = read_json(os.path.join(d, "pid.json"))
        child = self._children.get(d)
        if pids is None:
            if child is not None and child.poll() is None:
                child.send_signal(sig)  # the wrapper forwards it once the trainer starts
            return
        wrapper_alive = start_ticks(pids["pid"]) == pids["start_ticks"]
        leader_alive = start_ticks(pids["child_pgid"]) == pids["child_start_ticks"]
        if sig == signal.SIGTERM:
            if wrapper_alive:
                os.kill(pids["pid"], sig)  # forwarded to the trainer's group exactly once
            elif leader_alive:
                _killpg(pids["child_pgid"], sig)
        elif wrapper_alive or leader_alive:
            _killpg(pids["child_pgid"], sig)  # the wrapper then records 137 and exits


def _killpg(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
