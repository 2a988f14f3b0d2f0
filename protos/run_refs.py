"""Runs found by name: `run:NAME` in a path field instead of `.state/runs/j3/checkpoints/...`.

A job id depends on how many jobs came before; a run's name is what its config says. So a
config may name the checkpoint it starts from by the run that wrote it:

    checkpoint:
      path: run:guide-sft      # the newest checkpoint of the latest successful run guide-sft

- In a checkpoint field (`CHECKPOINT_FIELDS`) `run:NAME` is the newest complete checkpoint of
  the latest run named NAME that has one; in `eval.sweep` (every checkpoint of a run) it is that
  run's directory. Any other path field refuses it, naming the field.
- Which runs count is the caller's: the launcher offers its team's SUCCEEDED jobs named NAME,
  newest first (launcher/service.py), so a reference never reaches another team's run and never
  a run that failed or is still writing; a job run by hand (trainer/main.py) offers the run
  directories of its state dir (`runs_on_disk`): one called NAME (a run by hand), and launcher
  runs whose job is named NAME, the newest checkpoint first. A run directory does not say how
  its run ended, so by hand a failed run's last checkpoint counts too.
- It is resolved once, when the job is submitted (or started by hand), to an absolute path that
  goes into the spec as run; each `Resolution` is recorded (the launcher stores them on the job,
  `kitchen.v1.Job.resolved`), so a later run of the same name never changes what a job read.
"""

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protos.attempt_file import newest_attempt
from protos.config_yaml import ConfigError
from protos.paths import RUN_REF_PREFIX, checkpoint_dirs, path_fields, runs_dir

# Fields that name one checkpoint directory (a run reference gives the newest of the run's).
CHECKPOINT_FIELDS = frozenset(
    {
        "checkpoint.path",
        "rl.reference_path",
        "rl.reward_path",
        "hf.path",
        "distill.teacher_path",
        "serve.draft_path",
    }
)
RUN_DIR_FIELDS = frozenset({"eval.sweep"})  # fields that name a run directory
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # what a job name may be, to be found

# name -> (job id or "", run directory) of the runs that may answer, in the order to try them.
Candidates = Callable[[str], Iterable[tuple[str, str]]]


@dataclass(frozen=True)
class Resolution:
    field: str  # trainer.<field>, e.g. "checkpoint.path"
    reference: str  # what the config said: "run:guide-sft"
    job_id: str  # the launcher's job that wrote it ("" for a run by hand)
    path: str  # what the field now holds

    def describe(self) -> str:
        who = f"job {self.job_id}" if self.job_id else "a run by hand"
        return f"trainer.{self.field}: {self.reference} -> {self.path} ({who})"


def is_reference(value: str) -> bool:
    return value.startswith(RUN_REF_PREFIX)


def resolve(trainer_cfg, candidates: Candidates) -> list[Resolution]:
    """Replace every `run:NAME` of `trainer_cfg` (a kitchen.v1.TrainerConfig) in place by what
    it names among `candidates`; ConfigError naming the field when it names nothing."""
    done = []
    for dotted, message, field in path_fields(trainer_cfg):
        value = getattr(message, field)
        if not is_reference(value):
            continue
        where = f"trainer.{dotted}"
        if dotted not in CHECKPOINT_FIELDS | RUN_DIR_FIELDS:
            takes = ", ".join(f"trainer.{f}" for f in sorted(CHECKPOINT_FIELDS | RUN_DIR_FIELDS))
            raise ConfigError(
                where, f"{value}: a run reference names a checkpoint; only {takes} take one"
            )
        name = value[len(RUN_REF_PREFIX) :]
        if not _NAME.fullmatch(name):
            raise ConfigError(
                where, f"{value}: after 'run:' comes a job name (letters, digits, . _ -)"
            )
        path, job_id = _find(name, dotted in RUN_DIR_FIELDS, candidates)
        if not path:
            raise ConfigError(
                where,
                f"{value}: no successful run named {name!r} with a checkpoint"
                " (submit it first, or name the checkpoint's directory)",
            )
        setattr(message, field, path)
        done.append(Resolution(dotted, value, job_id, path))
    return done


def _find(name: str, want_run_dir: bool, candidates: Candidates) -> tuple[str, str]:
    for job_id, run_dir in candidates(name):
        found = checkpoint_dirs(run_dir)
        if found:
            return (run_dir if want_run_dir else found[-1]), job_id
    return "", ""


def runs_on_disk(state: str) -> Candidates:
    """The candidates of a job run by hand: the run directories of state dir `state` (see the
    module docstring), the one whose newest checkpoint is newest first."""

    def candidates(name: str) -> list[tuple[str, str]]:
        found = []
        try:
            entries = sorted(os.scandir(runs_dir(state)), key=lambda e: e.name)
        except OSError:
            return []
        for entry in entries:
            if not entry.is_dir():
                continue
            job_id = _launcher_job_named(entry.path, name)
            if entry.name == name or job_id:
                newest = checkpoint_dirs(entry.path)
                if newest:
                    found.append((os.path.getmtime(newest[-1]), job_id, entry.path))
        return [(job_id, path) for _, job_id, path in sorted(found, reverse=True)]

    return candidates


def _launcher_job_named(run_dir: str, name: str) -> str:
    """The job id of launcher run `run_dir` if its job is named `name` (its newest attempt's
    handoff says so: protos/attempt_file.py), else ""."""
    try:
        attempt = newest_attempt(run_dir)
    except (OSError, ValueError):
        return ""
    return attempt.job_id if attempt is not None and attempt.spec.name == name else ""
