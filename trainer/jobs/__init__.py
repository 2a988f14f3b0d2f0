"""The trainer's job kinds: `JOBS` is the one registry (job kind -> the function that runs it);
trainer/main.py parses, validates and dispatches here. Every training kind runs the one
training core with its recipe (jobs/train.py, trainer/recipes/)."""

import importlib

from protos import job_pb2
from protos.exit_codes import ExitCode
from protos.validation_kinds import TRAINING_KINDS
from trainer.jobs.context import JobContext

TRAIN = "trainer.jobs.train:run"

# job kind -> "module:function", imported when a job of that kind runs
JOBS: dict[int, str] = {
    job_pb2.PRECOOK: "trainer.jobs.precook:run",
    **dict.fromkeys(TRAINING_KINDS, TRAIN),
    job_pb2.EVAL: "trainer.jobs.evaluate:run",
    job_pb2.GENERATE: "trainer.jobs.generate:run",
    job_pb2.SERVE: "trainer.jobs.serve:run",
    job_pb2.EXPORT: "trainer.jobs.hf:export",
    job_pb2.IMPORT: "trainer.jobs.hf:import_",
}


def run(ctx: JobContext) -> ExitCode:
    """The job of `ctx.kind`."""
    module, name = JOBS[ctx.kind].split(":")
    return getattr(importlib.import_module(module), name)(ctx)
