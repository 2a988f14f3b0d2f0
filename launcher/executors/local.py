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
import sys
import time

from launcher.executors import image, task_array
from launcher.executors.attempt_wrapper import DUPLICATE, start_ticks, write_json_atomically
from launcher.executors.base import (
    OUTPUT_LOG,
    STARTUP_GRACE_SECONDS,
    Executor,
    Launch,
    Observed,
    Status,
    abandon,
    exit_status,
    job_env,
    read_json,
    torchrun,
    wrapped,
)
from protos.precook_steps import PrecookStep

TASK_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "task_driver.py")


class LocalExecutor(Executor):
    kind = "local"

    def __init__(self, torchrun_cmd: list, clock=time.time, images=None, sandbox=None):
        self.torchrun_cmd = torchrun_cmd
        self.clock = clock
        self.images = images  # kitchen.v1.ImageRunConfig, resolved: for jobs naming an image
        self.sandbox = sandbox  # a sandbox.Sandbox; None: plain subprocesses (SANDBOX_NONE)
        # attempt_dir -> Popen of the wrappers this process started
        self._children: dict[str, subprocess.Popen] = {}

    def start(self, launch: Launch):
        resources = launch.job.spec.resources
        env = job_env(launch)
        gpus = [g for node in launch.job.allocation for g in node.gpus]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        argv = launch.argv
        nproc = resources.processes_per_node or 1
        sandboxed = False
        if launch.job.spec.image:  # one node; torchrun inside the image for several processes
            argv = image.command(self.images, launch, env, ",".join(map(str, gpus)))
        elif nproc > 1:
            argv = torchrun(self.torchrun_cmd, argv, nproc, ["--standalone", "--nnodes=1"])
        os.makedirs(launch.attempt_dir, exist_ok=True)
        n_tasks, extra = task_array.n_tasks(launch.job), {}
        if n_tasks > 1:  # #21: a PRECOOK job's steps, driven by task_driver.py
            argv, extra = self._task_driver(launch, n_tasks, env, gpus), {"precook_tasks": n_tasks}
        elif self.sandbox is not None and not launch.job.spec.image:
            argv, sandboxed = self.sandbox.command(launch, argv, env, gpus), True
        with open(launch.log_path, "ab") as log:
            popen = subprocess.Popen(
                wrapped(launch.attempt_dir, argv, sandboxed=sandboxed),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not killed by a Ctrl-C meant for the launcher
                env=env,
                cwd=launch.job.run_dir,
            )
        self._children[launch.attempt_dir] = popen
        return {**launch.handle, "wrapper_pid": popen.pid, **extra}, Status.RUNNING

    def _task_driver(self, launch: Launch, n_tasks: int, env: dict, gpus: list) -> list:
        """The driver's command; its plan: the unfinished tasks, as many at once as CPUs, each
        in the sandbox."""
        d = launch.attempt_dir
        tasks = task_array.todo(task_array.run_dir_of(d), n_tasks)
        task_array.prepare_dirs(d, tasks)

        def step(s: PrecookStep, index: int | str = "") -> dict:
            where = task_array.step_dir(d, s, index)
            argv = task_array.step_argv(launch, s, str(index))
            if self.sandbox is not None:
                argv = self.sandbox.command(launch, argv, env, gpus)
            argv = wrapped(where, argv, sandboxed=self.sandbox is not None)
            return {"argv": argv, "log": os.path.join(where, OUTPUT_LOG)}

        plan = {
            "prepare": step(PrecookStep.PREPARE),
            "tasks": [[i, step(PrecookStep.TASK, i)] for i in tasks],
            "merge": step(PrecookStep.MERGE),
            "n_tasks": n_tasks,
            "parallel": min(n_tasks, os.cpu_count() or 1),
        }
        write_json_atomically(os.path.join(d, "steps.json"), plan)
        return [sys.executable, TASK_DRIVER, os.path.join(d, "steps.json")]

    def poll(self, handles: dict) -> dict:
        out = {}
        for job_id, h in handles.items():
            seen = self._poll_one(h)
            out[job_id] = task_array.observed(seen, h) if "precook_tasks" in h else seen
        return out

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
            elif leader_alive and "term_pid" in pids:  # sandboxed: bwrap would die of it
                _kill(pids["term_pid"], sig)
            elif leader_alive:
                _killpg(pids["child_pgid"], sig)
        elif wrapper_alive or leader_alive:
            _killpg(pids["child_pgid"], sig)  # the wrapper then records 137 and exits
        if sig == signal.SIGKILL:  # a PRECOOK job's steps: each trainer in its own group
            for pgid in task_array.step_pgids(d):
                _killpg(pgid, sig)


def _killpg(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _kill(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
