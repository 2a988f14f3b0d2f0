"""The steps of a PRECOOK job that runs as N tasks (`data.tasks`): the contract between the
launcher, which schedules them (launcher/executors/task_array.py), and the trainer, which runs
each as a process of its own (trainer/data/task_steps.py):

    <trainer> --attempt A.json --precook-step prepare           once: plan, tokenizer, job dir
    <trainer> --attempt A.json --precook-step task --task-index I   N times, any order
    <trainer> --attempt A.json --precook-step merge             once all tasks succeeded

Every step of one attempt shares the attempt's handoff file; `prepare` writes where the job
directory is (`JOB_POINTER`, in the run dir) for the others to read.
"""

import enum
import os

JOB_POINTER = "precook_job.json"  # in the run dir: {"directory": <the job directory>}


class PrecookStep(enum.Enum):
    PREPARE = "prepare"
    TASK = "task"
    MERGE = "merge"


def step_args(step: PrecookStep, index: str = "") -> list[str]:
    """The trainer arguments of one step (`index`: a task's, e.g. "$SLURM_ARRAY_TASK_ID")."""
    args = ["--precook-step", step.value]
    return [*args, "--task-index", index] if step == PrecookStep.TASK else args


def job_pointer(run_dir: str) -> str:
    return os.path.join(run_dir, JOB_POINTER)
