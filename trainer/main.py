"""`train`: the trainer's entry point, one per job, for every job kind: parse the job,
validate it, dispatch it to its kind (trainer/jobs/, the one registry).

    train --config configs/tiny.yaml [--run-dir DIR]   a job run by hand
    train --attempt ATTEMPT.json                       an attempt the launcher started

The launcher hands an attempt everything it did not configure itself (run directory, precook
cache, job id, attempt number, where to report, the token file) in one kitchen.v1.Attempt
(protos/attempt.proto). A job run by hand gets the same message built here: the run
directory is --run-dir or <state dir>/runs/<name>, the cache data.cache_dir or <state
dir>/precook (protos/paths.py), so it shares its precooked data with //trainer:precook.

Exit codes (protos/exit_codes.py): 0 success, 1 failure, 2 bad config or input (the message
names the field or file), 75 preempted (SIGTERM or the launcher's stop: checkpoint saved).
Run it under torchrun for several processes; only rank 0 writes logs and checkpoints.
"""

import argparse
import os
import sys
import traceback
from pathlib import Path

from google.protobuf import json_format

from protos import attempt_pb2, job_pb2, paths, provenance, run_refs
from protos.config_yaml import ConfigError, load_job_spec
from protos.exit_codes import ExitCode
from protos.precook_steps import PrecookStep
from protos.validation import validate_job_spec
from trainer.jobs.context import BadInput, JobContext, make_log


def attempt_from_config(config: str, run_dir: str = "") -> attempt_pb2.Attempt:
    """The Attempt of a job run by hand from a YAML config (paths are the user's)."""
    try:
        spec = load_job_spec(paths.user_path(config))
    except ConfigError as e:
        raise BadInput(str(e)) from e
    paths.absolute_paths(spec.trainer)
    state = paths.state_dir()
    try:  # `run:NAME` paths: among the run directories of this state dir (protos/run_refs.py)
        resolved = run_refs.resolve(spec.trainer, run_refs.runs_on_disk(state))
    except ConfigError as e:
        raise BadInput(f"{config}: {e}") from e
    if os.environ.get("RANK", "0") == "0":
        for r in resolved:
            print(r.describe(), flush=True)
    run_dir = paths.user_path(run_dir) or paths.run_dir_for(state, spec.name or "job")
    cache_dir = paths.precook_cache_dir(spec.trainer.data, state)
    return attempt_pb2.Attempt(spec=spec, run_dir=run_dir, cache_dir=cache_dir)


def read_attempt(path: str) -> attempt_pb2.Attempt:
    """The launcher's handoff (json_format of kitchen.v1.Attempt)."""
    try:
        attempt = json_format.Parse(Path(path).read_text(), attempt_pb2.Attempt())
    except (json_format.ParseError, OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not a kitchen.v1.Attempt: {e}") from e
    for field in ("run_dir", "cache_dir"):
        if not os.path.isabs(getattr(attempt, field)):
            raise BadInput(f"{path}: {field} must be an absolute path")
    return attempt


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML job spec (configs/*.yaml): a job run by hand")
    source.add_argument("--attempt", help="kitchen.v1.Attempt as JSON (from the launcher)")
    p.add_argument("--run-dir", help="with --config: where metrics, checkpoints and plots go")
    steps = [s.value for s in PrecookStep]  # #21: a PRECOOK job's tasks, run by the launcher
    p.add_argument("--precook-step", choices=steps, help="with --attempt: one step of its tasks")
    p.add_argument("--task-index", type=int, help="--precook-step task: which task, 0..N-1")
    args = p.parse_args(argv)
    if args.precook_step and not args.attempt:
        p.error("--precook-step runs a step of a launched attempt: give --attempt")
    if args.attempt and args.run_dir:
        p.error("--run-dir is the attempt's run_dir: give it with --config only")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.precook_step:  # one step of a PRECOOK job's tasks: no torch, no process group
            from trainer.data import task_steps

            attempt = read_attempt(paths.user_path(args.attempt))
            step = PrecookStep(args.precook_step)
            return int(task_steps.run(attempt, step, args.task_index))
        return int(_run(args))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return ExitCode.BAD_CONFIG


def _run(args) -> ExitCode:
    from trainer import distributed, jobs
    from trainer.data.errors import PrecookError

    if args.attempt:
        attempt = read_attempt(paths.user_path(args.attempt))
    else:
        attempt = attempt_from_config(args.config, args.run_dir or "")
    spec = attempt.spec
    try:  # the launcher ran the same check at submit; a job by hand meets it here
        cfg = validate_job_spec(spec, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise BadInput(f"{args.config or args.attempt}: {e}") from e
    kind = job_pb2.JobKind.Name(spec.kind)
    run_dir = Path(attempt.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = distributed.init()
    log = make_log(run_dir, env.is_main)
    log(f"{kind} job {spec.name or '(unnamed)'} -> {run_dir}")
    if env.is_main:  # which code this is: the MLflow run's tags, `kitchen diff`
        version = provenance.code_version()
        provenance.record_code(str(run_dir), attempt.number, version)
        log(f"code: {version.commit or '(commit unknown)'} ({version.how})")
    client = None
    if attempt.launcher and env.is_main:
        from trainer.progress_client import ProgressClient

        client = ProgressClient(attempt, log=log)
    ctx = JobContext(cfg, attempt, env, log, client)
    try:
        if client is not None:  # precooking can take a while: say the job is alive
            from protos import progress_pb2

            phase = {"EVAL": "eval", "GENERATE": "generate"}.get(kind, "precook")
            phase = {"EXPORT": "export", "IMPORT": "import"}.get(kind, phase)
            started = progress_pb2.Progress(
                phase=phase, message="started", job_id=attempt.job_id, attempt=attempt.number
            )
            client.send(started)
        code = jobs.run(ctx)
        # Every rank leaves together: a rank that tore the process group down while rank 0
        # still wrote its plot aborted now and then ("terminate called without an active
        # exception", exit -6). Only on success: after a failure a peer may be gone.
        distributed.barrier()
        return code
    except (PrecookError, ConfigError) as e:
        raise BadInput(str(e)) from e
    except BadInput:  # a checkpoint that does not load, ...: exit 2, not a failure to retry
        raise
    except Exception:
        log(f"FAILED:\n{traceback.format_exc()}")
        if not env.is_main:
            traceback.print_exc()
        return ExitCode.FAILED
    finally:
        if client is not None:
            client.close()
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
