"""A finished run read back from its run directory, for `kitchen track import` and `kitchen diff`.

What decides a run is in the directory: the spec (a launcher's run: the newest
`attempts/<NNN>/attempt.json`, the Attempt the trainer was started with; a run by hand: the YAML
config it was started from, given with --config), its metrics.jsonl, its checkpoints' meta.json.
"""

import os
from dataclasses import dataclass

from launcher.tracking import records
from launcher.tracking.records import Point
from protos import job_pb2
from protos.attempt_file import ATTEMPT_FILE, ATTEMPTS_DIR, newest_attempt
from protos.config_yaml import load_job_spec
from protos.progress_log import read_progress_log


class RunDirError(ValueError):
    """The directory is not a run Kitchen can read; the message names the path."""


@dataclass
class Run:
    job: job_pb2.Job  # id, spec, run_dir, final state as far as the log tells
    points: list[Point]  # every metric value, the last record of each (key, step)
    warnings: list[str]


def read_run(run_dir: str, config: str = "") -> Run:
    """The run in `run_dir`; `config` (a job YAML) gives the spec of a run started by hand."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise RunDirError(f"{run_dir}: no such run directory")
    log = read_progress_log(run_dir)  # FileNotFoundError / ProgressLogError name the file
    try:
        attempt = newest_attempt(run_dir)
    except ValueError as err:
        raise RunDirError(str(err)) from err
    warnings = list(log.warnings)
    if config:
        spec = load_job_spec(config)  # ConfigError names file and field
        job_id = f"run:{run_dir}"
    elif attempt is not None:
        spec, job_id = attempt.spec, attempt.job_id
    else:
        raise RunDirError(
            f"{run_dir}: no {ATTEMPTS_DIR}/*/{ATTEMPT_FILE} (not started by a launcher): give the "
            "job's YAML with --config"
        )
    job = job_pb2.Job(id=job_id, spec=spec, run_dir=run_dir)
    if any(p.phase == "done" for p in log.records):
        job.state = job_pb2.SUCCEEDED
    timestamp = int(os.path.getmtime(log.path) * 1000)
    latest: dict[tuple[str, int], Point] = {}
    for p in log.records:  # a step logged again (resume, rollback): its last record counts
        for point in records.progress_points(p, spec.kind, timestamp):
            latest[(point.key, point.step)] = point
    points = sorted(latest.values(), key=lambda q: (q.key, q.step))
    return Run(job, points, warnings)
