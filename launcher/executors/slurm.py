"""Runs attempts as Slurm batch jobs: sbatch to start, squeue --json to watch, scancel to stop.

The batch script `exec`s attempt_wrapper.py, so the batch step *is* the wrapper: SIGTERM from
`scancel --batch --signal=TERM` reaches it and it forwards to the trainer (which checkpoints
and exits 75), and its exit.json in the run dir (a shared filesystem, as Slurm clusters have)
tells the exit code even after Slurm has forgotten the job. Jobs are named
`kitchen-<job>-a<attempt>`, so a launcher that crashed right after sbatch finds its job again.
Several nodes or processes per node run under `srun torchrun` with a c10d rendezvous on the
first node of the allocation.
"""

import json
import logging
import os
import shlex
import subprocess
import sys
import time

from launcher.executors import image, task_array
from launcher.executors.base import (
    STARTUP_GRACE_SECONDS,
    Executor,
    Launch,
    Observed,
    Status,
    abandon,
    exit_status,
    job_env,
    wrapped,
)
from protos.precook_steps import PrecookStep

log = logging.getLogger("kitchen.launcher")
RUNNING_STATES = {"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING"}
PENDING_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"}
RENDEZVOUS_PORT = 29500


class SlurmError(RuntimeError):
    pass


def _attempt_name(launch: Launch) -> str:
    return f"kitchen-{launch.job.id}-a{launch.job.attempts}"


def _step_name(attempt_name: str, step: PrecookStep) -> str:
    """The Slurm job name of one step of a PRECOOK job's attempt (its tasks share one)."""
    return f"{attempt_name}-{step.value}"


def _exports(launch: Launch) -> str:
    """The batch script's environment: the job's own (base.job_env's rule). sbatch runs with
    --export=NIL, so nothing of the launcher's environment reaches the node; srun steps
    inside take the script's (SLURM_EXPORT_ENV=ALL)."""
    env = {**job_env(launch), "SLURM_EXPORT_ENV": "ALL"}
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))


def _run(argv, env=None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if done.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class SlurmExecutor(Executor):
    kind = "slurm"

    def __init__(
        self, cfg, torchrun_cmd: list, python: str = sys.executable, clock=time.time, images=None
    ):
        self.cfg = cfg  # kitchen.v1.SlurmPoolConfig
        self.torchrun_cmd = torchrun_cmd
        self.python = python
        self.clock = clock
        self.images = images  # kitchen.v1.ImageRunConfig, resolved: for jobs naming an image

    def _script(self, launch: Launch) -> str:
        r = launch.job.spec.resources
        nodes, nproc = r.nodes or 1, r.processes_per_node or 1
        argv = launch.argv
        if launch.job.spec.image:  # one node; torchrun inside the image for several processes
            # Slurm picks the GPUs when the job starts: the script reads them from its env.
            gpus = "$SLURM_JOB_GPUS" if r.gpus_per_node else ""
            argv = image.command(self.images, launch, launch.env, gpus)
        elif nodes > 1 or nproc > 1:
            rendezvous = [
                f"--nnodes={nodes}", "--rdzv-backend=c10d",
                f'--rdzv-endpoint="$head":{RENDEZVOUS_PORT}', f"--rdzv-id={launch.job.id}",
                f"--nproc-per-node={nproc}", "--no-python",
            ]  # fmt: skip
            argv = ["srun", "--ntasks-per-node=1", *self.torchrun_cmd, *rendezvous, *argv]
        command = " ".join(
            a if a.startswith(("--rdzv-endpoint", "--gpus=$")) else shlex.quote(a)
            for a in wrapped(launch.attempt_dir, argv, self.python)
        )
        exports = _exports(launch)
        head = 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        return f"#!/bin/bash\n{exports}{head}exec {command}\n"

    def start(self, launch: Launch):
        n_tasks = task_array.n_tasks(launch.job)
        if n_tasks > 1:
            return self._start_tasks(launch, n_tasks)
        r = launch.job.spec.resources
        name = _attempt_name(launch)
        os.makedirs(launch.attempt_dir, exist_ok=True)
        script = os.path.join(launch.attempt_dir, "batch.sh")
        with open(script, "w") as f:
            f.write(self._script(launch))
        argv = [
            "sbatch", "--parsable", "--export=NIL", f"--job-name={name}",
            f"--output={launch.log_path}",
            f"--chdir={launch.job.run_dir}", f"--nodes={r.nodes or 1}", "--ntasks-per-node=1",
        ]  # fmt: skip
        if r.gpus_per_node:
            argv.append(f"--gres=gpu:{r.gpus_per_node}")
        if self.cfg.partition:
            argv.append(f"--partition={self.cfg.partition}")
        argv += [*self.cfg.sbatch_args, script]
        slurm_id = _run(argv).strip().split(";")[0]
        return {**launch.handle, "name": name, "slurm_job_id": slurm_id}, Status.PENDING

    # ------------------------------------------------- a PRECOOK job's steps (task_array.py)

    def _start_tasks(self, launch: Launch, n_tasks: int):
        """prepare, then one array job of the unfinished tasks, then merge, chained with
        `afterok` dependencies: Slurm cancels the merge once a task fails."""
        d = launch.attempt_dir
        tasks = task_array.todo(task_array.run_dir_of(d), n_tasks)
        task_array.prepare_dirs(d, tasks)
        name = _attempt_name(launch)
        after = self._sbatch_step(launch, PrecookStep.PREPARE, [])
        ids = [after]
        if tasks:
            array = [f"--array={','.join(map(str, tasks))}", f"--dependency=afterok:{after}"]
            after = self._sbatch_step(
                launch, PrecookStep.TASK, [*array, "--kill-on-invalid-dep=yes"]
            )
            ids.append(after)
        merge = [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
        ids.append(self._sbatch_step(launch, PrecookStep.MERGE, merge))
        handle = {**launch.handle, "name": name, "slurm_job_ids": ids, "precook_tasks": n_tasks,
                  "precook_todo": tasks}  # fmt: skip
        return handle, Status.PENDING

    def _sbatch_step(self, launch: Launch, step: PrecookStep, flags: list) -> str:
        d, index = launch.attempt_dir, "$SLURM_ARRAY_TASK_ID"
        argv = task_array.step_argv(launch, step, index)
        command = " ".join(  # the array task's index expands in the script
            f'"{a}"' if index in a else shlex.quote(a)
            for a in wrapped(task_array.step_dir(d, step, index), argv, self.python)
        )
        exports = _exports(launch)
        script = os.path.join(d, f"{step.value}.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/bash\n{exports}exec {command}\n")
        argv = [
            "sbatch", "--parsable", "--export=NIL",
            f"--job-name={_step_name(_attempt_name(launch), step)}",
            "--ntasks=1",
            f"--output={os.path.join(task_array.step_dir(d, step, '%a'), 'output.log')}",
            f"--chdir={launch.job.run_dir}", *flags,
        ]  # fmt: skip
        if self.cfg.partition:
            argv.append(f"--partition={self.cfg.partition}")
        return _run([*argv, *self.cfg.sbatch_args, script]).strip().split(";")[0]

    def _poll_tasks(self, h: dict) -> Observed:
        """The attempt ends when merge does, or when a step failed and no task still runs (the
        tasks that can finish do: their parts count for the retry)."""
        names = [_step_name(h["name"], s) for s in PrecookStep]
        queue = json.loads(_run(["squeue", "--json", f"--name={','.join(names)}"]))["jobs"]
        d, n = h["attempt_dir"], h["precook_tasks"]
        ended = task_array.merged(d)
        if ended is not None:
            return ended
        running = [j for j in queue if j["job_state"] in RUNNING_STATES]
        waiting = [j for j in queue if j["job_state"] in PENDING_STATES]
        for j in waiting:  # what --kill-on-invalid-dep should have cancelled: cancel it now
            if j.get("state_reason") == "DependencyNeverSatisfied":
                self._cancel(str(j["job_id"]))
        waiting = [j for j in waiting if j.get("state_reason") != "DependencyNeverSatisfied"]
        failed = task_array.failed_step(d, range(n), n)
        if failed is not None:
            merge = _step_name(h["name"], PrecookStep.MERGE)
            if running or any(j["name"] != merge for j in waiting):
                return Observed(Status.RUNNING)
            for j in waiting:  # a merge whose dependency can never be met
                self._cancel(str(j["job_id"]))
            return failed
        if running or waiting:
            return Observed(Status.RUNNING if running else Status.PENDING)
        ended = task_array.merged(d)  # it may have just finished
        if ended is not None:
            return ended
        gone = [i for i in h["precook_todo"] if not os.path.exists(os.path.join(
            task_array.step_dir(d, PrecookStep.TASK, i), "exit.json"))]  # fmt: skip
        return Observed(Status.LOST, detail=f"Slurm jobs {h['slurm_job_ids']} are gone without "
                        f"a merge (tasks that never ended: {gone})")  # fmt: skip

    # ---------------------------------------------------------------- every job

    def poll(self, handles: dict) -> dict:
        out, ask = {}, {}
        for job_id, h in handles.items():
            if "precook_tasks" in h:
                out[job_id] = task_array.observed(self._poll_tasks(h), h)
                continue
            ended = exit_status(h["attempt_dir"])
            if ended is not None:
                out[job_id] = ended
            else:
                ask[job_id] = h
        if not ask:
            return out
        by_id, by_name = self._squeue(ask.values())
        for job_id, h in ask.items():
            entry = by_id.get(h.get("slurm_job_id")) or by_name.get(h.get("name"))
            out[job_id] = self._observe(h, entry)
        return out

    def _squeue(self, handles):
        ids = [h["slurm_job_id"] for h in handles if h.get("slurm_job_id")]
        names = [h["name"] for h in handles if not h.get("slurm_job_id") and h.get("name")]
        by_id, by_name = {}, {}
        for flag, values in (("--jobs", ids), ("--name", names)):
            if values:
                try:
                    jobs = json.loads(_run(["squeue", "--json", f"{flag}={','.join(values)}"]))
                except SlurmError:
                    continue  # squeue rejects ids Slurm already purged: ask one by one below
                for j in jobs.get("jobs", []):
                    by_id[str(j["job_id"])] = j
                    by_name[j["name"]] = j
        return by_id, by_name

    def _observe(self, h, entry) -> Observed:
        if entry is not None:
            state = entry["job_state"]
            if state in RUNNING_STATES:
                return Observed(Status.RUNNING)
            if state in PENDING_STATES:
                return Observed(Status.PENDING)
            ended = exit_status(h["attempt_dir"])  # the wrapper may have written it just now
            if ended is not None:
                return ended
            reason = entry.get("state_reason", "")
            return Observed(Status.LOST, detail=f"Slurm job {entry['job_id']} {state} ({reason})")
        if h.get("slurm_job_id"):
            ended = exit_status(h["attempt_dir"])
            if ended is not None:
                return ended
            return Observed(Status.LOST, detail=f"Slurm job {h['slurm_job_id']} is gone")
        if self.clock() - h["launched_at"] < STARTUP_GRACE_SECONDS:
            return Observed(Status.PENDING)
        return abandon(h["attempt_dir"], self.clock())  # never submitted: the launcher died first

    def _slurm_id(self, handle):
        if handle.get("slurm_job_id"):
            return handle["slurm_job_id"]
        _, by_name = self._squeue([handle])
        entry = by_name.get(handle.get("name"))
        return str(entry["job_id"]) if entry else None

    def terminate(self, handle: dict):
        if "slurm_job_ids" in handle:  # a PRECOOK job's steps: all of them
            for step_id in handle["slurm_job_ids"]:
                self._cancel(step_id)
            return
        slurm_id = self._slurm_id(handle)
        if slurm_id is None:
            return
        try:
            _run(["scancel", "--batch", "--signal=TERM", slurm_id])
        except SlurmError:
            self._cancel(slurm_id)  # still pending: there is no process to signal

    def kill(self, handle: dict):
        if "slurm_job_ids" in handle:
            for step_id in handle["slurm_job_ids"]:
                try:
                    _run(["scancel", "--full", "--signal=KILL", step_id])
                except SlurmError:
                    self._cancel(step_id)
            return
        slurm_id = self._slurm_id(handle)
        if slurm_id is None:
            return
        try:
            _run(["scancel", "--full", "--signal=KILL", slurm_id])
        except SlurmError:
            self._cancel(slurm_id)

    def _cancel(self, slurm_id):
        try:
            _run(["scancel", slurm_id])  # SIGTERM, then SIGKILL after the cluster's KillWait
        except SlurmError as e:
            log.warning("%s (the job may have ended already)", e)
