"""A distributed precook's tasks as a Slurm array job, on the launcher's Slurm pool.

The pool's settings (kitchen.v1.SlurmPoolConfig: partition, extra sbatch flags) are the ones the
launcher's Slurm executor submits training jobs with. One `sbatch --array=0-(N-1)` runs every
unfinished task (`$SLURM_ARRAY_TASK_ID` picks the slice); each writes its part to the job
directory, on the filesystem the cluster shares, and the part's presence, not Slurm's memory
of the job, says it finished. Once the array has left the queue, the tasks without a part are
resubmitted alone (`--array=i,j`), up to `retries` times.
"""

import json
import os
import shlex
import subprocess
import time

from protos.launcher_pb2 import SlurmPoolConfig
from trainer.data.tasks import Job, TaskError, done, task_argv


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise TaskError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def submit(job: Job, pool: SlurmPoolConfig, indices: list[int]) -> str:
    """sbatch an array of the tasks `indices`; the Slurm job id."""
    logs = os.path.join(job.directory, "logs")
    os.makedirs(logs, exist_ok=True)
    script = os.path.join(job.directory, "task.sh")
    command = " ".join(shlex.quote(a) for a in task_argv(job.directory, "INDEX"))
    with open(script, "w") as f:
        f.write(f"#!/bin/bash\nexec {command.replace('INDEX', '$SLURM_ARRAY_TASK_ID')}\n")
    argv = [
        "sbatch", "--parsable", f"--array={','.join(map(str, indices))}",
        f"--job-name=kitchen-precook-{os.path.basename(job.directory)}",
        f"--output={logs}/task-%a.log", f"--chdir={os.getcwd()}", "--ntasks=1",
    ]  # fmt: skip
    if pool.partition:
        argv.append(f"--partition={pool.partition}")
    argv += [*pool.sbatch_args, script]
    return _run(argv).strip().split(";")[0]


def queued(slurm_id: str) -> bool:
    """Whether any task of array job `slurm_id` is still pending or running."""
    try:
        jobs = json.loads(_run(["squeue", "--json", f"--jobs={slurm_id}"])).get("jobs", [])
    except TaskError:
        return False  # squeue refuses a job id Slurm has already purged
    return any(j.get("job_state") not in ("COMPLETED", "FAILED", "CANCELLED") for j in jobs)


def run_slurm(
    job: Job, pool: SlurmPoolConfig, retries: int = 1, poll_s: float = 0.5
) -> dict[int, int]:
    """Run the unfinished tasks as an array job, then retry the failed ones alone. Returns
    attempts per task (submissions that included it); TaskError if one never finishes."""
    attempts = {i: 0 for i in range(job.n_tasks)}
    todo = [i for i in range(job.n_tasks) if i not in done(job)]
    for _ in range(retries + 1):
        if not todo:
            return attempts
        slurm_id = submit(job, pool, todo)
        for i in todo:
            attempts[i] += 1
        while queued(slurm_id):
            time.sleep(poll_s)
        todo = [i for i in todo if i not in done(job)]
    if todo:
        logs = os.path.join(job.directory, "logs")
        raise TaskError(f"tasks {todo} failed {retries + 1} times (logs in {logs})")
    return attempts
