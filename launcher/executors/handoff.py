"""The launcher's half of the trainer contract: the files one attempt is started with.

Before an attempt starts, `write()` puts into its attempt dir (`<run_dir>/attempts/<NNN>/`):
- `attempt.json`: a `kitchen.v1.Attempt` (protos/attempt.proto) as JSON, written atomically:
  job id, attempt number, the spec as stored, run dir, precook cache dir, the launcher's
  advertised address, the token file and the TLS root certificate;
- `token` (mode 0600 from its creation), only when auth is on: the attempt's bearer token for
  ReportProgress. It is never put in argv, the environment or attempt.json, so `ps` and
  /proc/<pid>/environ of the attempt's processes do not show it.
The trainer is then started as `<trainer_cmd> --attempt <attempt_dir>/attempt.json`
(`Launch.trainer_args`); executors that run it elsewhere mount these files (image.py binds
the run dir; kubernetes.py renders them as a ConfigMap and a Secret).
"""

import os

from google.protobuf import json_format

from protos import attempt_pb2, job_pb2, launcher_addresses, launcher_pb2
from protos.attempt_file import ATTEMPT_FILE
from protos.files import write_atomic
from protos.paths import precook_cache_dir

TOKEN_FILE = "token"
SECRET_MODE = 0o600


def attempt_message(
    job: job_pb2.Job, cfg: launcher_pb2.LauncherConfig, token_file: str = ""
) -> attempt_pb2.Attempt:
    """What the trainer of `job`'s current attempt is told (`cfg`: the resolved config)."""
    spec = job_pb2.JobSpec()
    spec.CopyFrom(job.spec)  # the launcher's word on what the job may do, not the submitter's:
    allowed = job.spec.team in cfg.task_code_teams
    if allowed or spec.trainer.eval.allow_task_code:
        spec.trainer.eval.allow_task_code = allowed
    return attempt_pb2.Attempt(
        job_id=job.id,
        number=job.attempts,
        spec=spec,
        run_dir=job.run_dir,
        cache_dir=precook_cache_dir(job.spec.trainer.data, cfg.state_dir, job.spec.team),
        launcher=launcher_addresses.join([cfg.advertise, *cfg.store.postgres.replica_addresses]),
        token_file=token_file,
        tls_ca=cfg.tls_cert,
    )


def to_json(attempt: attempt_pb2.Attempt) -> str:
    return json_format.MessageToJson(attempt, preserving_proto_field_name=True) + "\n"


def write(
    job: job_pb2.Job, cfg: launcher_pb2.LauncherConfig, attempt_dir: str, token: str
) -> attempt_pb2.Attempt:
    """Writes the attempt's handoff files (see the module docstring); returns the Attempt."""
    os.makedirs(attempt_dir, exist_ok=True)
    token_file = ""
    if token:
        token_file = os.path.join(attempt_dir, TOKEN_FILE)
        write_atomic(token_file, token, mode=SECRET_MODE)
    attempt = attempt_message(job, cfg, token_file)
    write_atomic(os.path.join(attempt_dir, ATTEMPT_FILE), to_json(attempt))
    return attempt
