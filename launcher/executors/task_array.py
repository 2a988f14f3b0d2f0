"""A PRECOOK job with `data.tasks` N: one attempt of steps (protos/precook_steps.py), each a
trainer process under attempt_wrapper.py with its own directory in the attempt dir:

    prepare/      plan the inputs, train the tokenizer once, write the job directory
    tasks/<i>/    task i tokenizes its slice into its part (N of them: a Slurm array, or
                  local processes through task_driver.py)
    merge/        the parts -> the tokenized corpus, packing, the manifest

The launcher knows which tasks succeeded from their exit.json files, in this attempt and every
earlier one of the job, so a retry (the job's retry policy, after a task failed) runs prepare,
only the tasks that never succeeded, and merge. A task whose part exists also returns at once
(trainer/data/tasks.py), so a task is never redone. The slicing and merging are the trainer's;
which step runs where and when is the launcher's.
"""

import glob
import os
from collections.abc import Iterable

from launcher.executors.attempt_wrapper import start_ticks
from launcher.executors.base import Launch, Observed, exit_status, last_line, read_json
from protos import job_pb2
from protos.attempt_file import ATTEMPTS_DIR, OUTPUT_LOG
from protos.precook_steps import PrecookStep, step_args

TASKS_DIR = "tasks"


def n_tasks(job: job_pb2.Job) -> int:
    """How many tasks the job runs as (1: an ordinary attempt). A job in an image runs its
    tasks inside the image, as local processes (trainer/data/task_steps.py)."""
    if job.spec.kind != job_pb2.PRECOOK or job.spec.image:
        return 1
    return max(job.spec.trainer.data.tasks, 1)


def step_dir(attempt_dir: str, step: PrecookStep, index: int | str = "") -> str:
    if step == PrecookStep.TASK:
        return os.path.join(attempt_dir, TASKS_DIR, str(index))
    return os.path.join(attempt_dir, step.value)


def step_argv(launch: Launch, step: PrecookStep, index: str = "") -> list:
    """The trainer command of one step (`index` may be "$SLURM_ARRAY_TASK_ID")."""
    return [*launch.argv, *step_args(step, index)]


def run_dir_of(attempt_dir: str) -> str:
    return os.path.dirname(os.path.dirname(attempt_dir))  # <run_dir>/attempts/<N>


def succeeded(run_dir: str) -> set[int]:
    """The tasks that exited 0 in any attempt of the job."""
    out = set()
    for path in glob.glob(os.path.join(run_dir, ATTEMPTS_DIR, "*", TASKS_DIR, "*", "exit.json")):
        ended = read_json(path)
        index = os.path.basename(os.path.dirname(path))
        if ended is not None and ended.get("code") == 0 and index.isdigit():
            out.add(int(index))
    return out


def todo(run_dir: str, n: int) -> list[int]:
    """The tasks an attempt must run: those that have not succeeded yet."""
    done = succeeded(run_dir)
    return [i for i in range(n) if i not in done]


def prepare_dirs(attempt_dir: str, tasks: list[int]) -> None:
    """Every step's directory, made before anything starts (Slurm writes logs into them)."""
    for step in (PrecookStep.PREPARE, PrecookStep.MERGE):
        os.makedirs(step_dir(attempt_dir, step), exist_ok=True)
    for i in tasks:
        os.makedirs(step_dir(attempt_dir, PrecookStep.TASK, i), exist_ok=True)


def observed(seen: Observed, handle: dict) -> Observed:
    """`seen` with the job's tasks done/total (its progress) and, for a failed attempt, the
    step that failed."""
    n, attempt_dir = handle["precook_tasks"], handle["attempt_dir"]
    done = len(succeeded(run_dir_of(attempt_dir)) & set(range(n)))
    detail = seen.detail
    if seen.exit_code not in (0, None):
        failed = failed_step(attempt_dir, range(n), n)
        detail = failed.detail if failed is not None else detail
    return Observed(seen.status, seen.exit_code, detail, tasks=(done, n))


def failed_step(attempt_dir: str, tasks: Iterable[int], n: int) -> Observed | None:
    """The first step of the attempt that ended badly, as the attempt's end: prepare, a task
    (the lowest index), merge. None: no step has failed (so far)."""
    named = [(step_dir(attempt_dir, PrecookStep.PREPARE), "prepare")]
    named += [(step_dir(attempt_dir, PrecookStep.TASK, i), f"task {i} of {n}") for i in tasks]
    named.append((step_dir(attempt_dir, PrecookStep.MERGE), "merge"))
    for directory, what in named:
        ended = exit_status(directory)
        if ended is not None and ended.exit_code != 0:
            said = ended.detail or last_line(os.path.join(directory, OUTPUT_LOG))
            return Observed(
                ended.status, ended.exit_code, f"precook {what} exited {ended.exit_code}: {said}"
            )
    return None


def merged(attempt_dir: str) -> Observed | None:
    """How the merge step ended (None: it has not)."""
    return exit_status(step_dir(attempt_dir, PrecookStep.MERGE))


def last_output(attempt_dir: str) -> float:
    """When a step of the attempt last wrote to its log (0: none has). The steps send no
    progress reports, and one task can run for hours before any finishes, so the launcher's
    hang detector takes a step's log line as a sign of life (a task writes precook's progress
    line, trainer/data/progress.py, every few seconds while it tokenizes)."""
    logs = glob.glob(os.path.join(attempt_dir, "*", OUTPUT_LOG))
    logs += glob.glob(os.path.join(attempt_dir, TASKS_DIR, "*", OUTPUT_LOG))
    times = []
    for path in logs:
        try:
            times.append(os.path.getmtime(path))
        except OSError:  # a step directory being removed
            pass
    return max(times, default=0.0)


def step_pgids(attempt_dir: str) -> list[int]:
    """The process groups of the steps' trainers that are still alive (for a SIGKILL)."""
    out = []
    for path in glob.glob(os.path.join(attempt_dir, "**", "pid.json"), recursive=True):
        pids = read_json(path)
        if path != os.path.join(attempt_dir, "pid.json") and pids is not None:
            if start_ticks(pids["child_pgid"]) == pids["child_start_ticks"]:
                out.append(pids["child_pgid"])
    return out
