"""A PRECOOK job with `data.tasks` N, one step per process (protos/precook_steps.py says which
step and how the launcher asks for it; tasks.py does the work).

The launcher runs `prepare`, then the N tasks on its pool (a Slurm array, or local processes),
then `merge`; a retried attempt runs `prepare` again (it finds the job directory and its parts)
and only the tasks that have not succeeded. No step imports torch or joins a process group.
By hand (`train --config` of such a job) the same steps run here as local processes.
"""

import json
import sys

from protos import attempt_pb2, files
from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from protos.precook_steps import PrecookStep, job_pointer
from protos.trainer_config_pb2 import DataConfig
from protos.validation import resolve_data, validate_job_spec
from trainer.data import tasks
from trainer.data.errors import PrecookError
from trainer.data.precook import PrecookedDataset
from trainer.data.progress import reporter


def run(attempt: attempt_pb2.Attempt, step: PrecookStep, index: int | None) -> ExitCode:
    """One step of the attempt's job; exit code 2 (not retried) for bad config or input."""
    say = reporter(True)
    try:
        data = validate_job_spec(attempt.spec).data
        if step == PrecookStep.PREPARE:
            job = tasks.prepare(data, attempt.cache_dir, data.tasks, say)
            pointer = {"directory": job.directory, "tasks": job.n_tasks}
            files.write_json_atomic(job_pointer(attempt.run_dir), pointer)
            say(f"prepared {job.n_tasks} tasks of {len(job.plan.units)} units in {job.directory}")
        elif step == PrecookStep.TASK:
            if index is None:
                raise ConfigError("--task-index", "the task step needs the task's index")
            ran = tasks.run_task(_job_directory(attempt), index)
            say(f"task {index}: {'done' if ran else 'already done'}")
        else:
            ds = tasks.merge(tasks.load(_job_directory(attempt)), attempt.cache_dir, say)
            say(summary(ds))
    except (ConfigError, PrecookError) as e:
        print(f"precook {step.value}: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.BAD_CONFIG
    return ExitCode.OK


def _job_directory(attempt: attempt_pb2.Attempt) -> str:
    """Where this attempt's prepare step put the job (a task or merge runs after it)."""
    path = job_pointer(attempt.run_dir)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["directory"]
    except (OSError, ValueError, KeyError) as e:
        raise tasks.TaskError(f"{path}: no prepared job ({e}): the prepare step runs first") from e


def precook_as_tasks(data: DataConfig, cache_dir: str, quiet: bool = False) -> PrecookedDataset:
    """The whole job in this process's hands: prepare, `data.tasks` local processes, merge."""
    say = reporter(not quiet)
    n_tasks = resolve_data(data).tasks
    job = tasks.prepare(data, cache_dir, n_tasks, say)
    attempts = tasks.run_local(job)
    say(f"tasks done (attempts per task: {attempts}); merging")
    return tasks.merge(job, cache_dir, say, show_progress=not quiet)


def summary(ds: PrecookedDataset) -> str:
    c = ds.manifest.counts
    return (
        f"precooked {c.documents:,} documents, {c.tokens:,} tokens in {c.rows:,} rows "
        f"({c.padding_tokens:,} padding tokens)"
    )
