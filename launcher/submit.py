"""Submit a job from a YAML config and follow it to the end.

    bazel run //launcher:submit -- --config configs/tiny.yaml [--launcher ADDR] [--detach]

Without --launcher, an embedded launcher starts in this process (local executor, store and
run dirs in the state dir: $KITCHEN_STATE_DIR, else .state/ in the workspace), runs the job and
stops. The exit code is the job's outcome: 0 succeeded, 1 failed, 2 bad config, 130 cancelled
(Ctrl-C cancels the job: the trainer saves a checkpoint first). With --launcher the job goes
to that launcher; Ctrl-C then only stops following (the job keeps running).
"""

import argparse
import getpass
import shlex
import signal
import sys
import threading

import grpc

from launcher.client import Client
from launcher.live_view import EXIT_CODES, LiveView, follow
from launcher.server import Launcher, StateDirBusy
from launcher.store_base import StoreError
from protos import job_pb2, launcher_pb2
from protos.config_yaml import ConfigError, load_job_spec
from protos.enums import enum_name
from protos.exit_codes import ExitCode
from protos.paths import absolute_paths, state_dir, user_path
from protos.validation import validate_job_spec


def load_spec(path: str) -> job_pb2.JobSpec:
    """The job in the YAML file at `path`, checked as the launcher and trainer will check it,
    with its paths made absolute here: a trainer runs in its run dir, not where you are."""
    spec = load_job_spec(path)
    spec.owner = spec.owner or getpass.getuser()
    absolute_paths(spec.trainer)
    try:
        validate_job_spec(spec)
    except ConfigError as e:
        raise ConfigError(e.field, e.problem, path) from None
    return spec


def _embedded(args) -> Launcher:
    cfg = launcher_pb2.LauncherConfig(
        listen="127.0.0.1:0",
        metrics_listen=f"127.0.0.1:{args.metrics_port}",
        state_dir=user_path(args.state_dir) if args.state_dir else "",
    )
    if args.trainer_cmd:
        cfg.trainer_cmd.extend(shlex.split(args.trainer_cmd))
    launcher = Launcher(cfg).start()
    print(f"launcher: embedded on {launcher.address}; state in {launcher.cfg.state_dir}")
    if launcher.metrics_port:
        print(f"metrics:  http://127.0.0.1:{launcher.metrics_port}/metrics")
    print(f"trainer:  {shlex.join(launcher.cfg.trainer_cmd)}")
    return launcher


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="submit", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="job YAML (keys: kitchen.v1.JobSpec fields)")
    p.add_argument(
        "--launcher",
        help="launcher address, or replicas' addresses comma-separated (default: start one "
        "in this process)",
    )
    p.add_argument("--detach", action="store_true", help="print the job id and return")
    p.add_argument("--token", help="bearer token (default $KITCHEN_TOKEN)")
    p.add_argument("--tls-ca", help="PEM root certificate (default $KITCHEN_TLS_CA)")
    p.add_argument("--state-dir", help=f"embedded launcher's state (default {state_dir()})")
    p.add_argument("--metrics-port", type=int, default=0, help="embedded /metrics port (0: any)")
    p.add_argument(
        "--trainer-cmd", help="embedded launcher's trainer command (default //trainer:train)"
    )
    args = p.parse_args(argv)
    try:
        spec = load_spec(user_path(args.config))
    except ConfigError as e:
        print(f"submit: {e}", file=sys.stderr)
        return ExitCode.BAD_CONFIG
    if args.detach and not args.launcher:
        print(
            "submit: --detach needs --launcher (an embedded launcher ends with submit)",
            file=sys.stderr,
        )
        return ExitCode.BAD_CONFIG
    launcher = None
    try:
        if args.launcher:
            client = Client(args.launcher, args.token, args.tls_ca)
        else:
            launcher = _embedded(args)
            client = Client(launcher.address)
        return _run(client, spec, args, embedded=launcher is not None)
    except (StateDirBusy, StoreError) as e:
        print(f"submit: {e}", file=sys.stderr)
        return ExitCode.BAD_CONFIG
    except grpc.RpcError as e:
        print(f"submit: {e.code().name}: {e.details()}", file=sys.stderr)
        bad = e.code() == grpc.StatusCode.INVALID_ARGUMENT
        return ExitCode.BAD_CONFIG if bad else ExitCode.FAILED
    finally:
        if launcher is not None:
            launcher.stop()


def _run(client: Client, spec, args, embedded: bool) -> int:
    job = client.submit(spec)
    kind = enum_name(spec, "kind").lower()
    print(f"submitted {job.id} ({spec.name}, {kind}); run dir {job.run_dir}")
    for r in job.resolved:  # `run:NAME` paths, resolved by the launcher (protos/run_refs.py)
        print(f"  trainer.{r.field}: {r.reference} -> {r.path} (job {r.job_id})")
    if args.detach:
        print(f"follow it with: kitchen --launcher {args.launcher} watch {job.id}")
        return 0
    interrupted = threading.Event()

    def on_interrupt(_signum, _frame):
        if interrupted.is_set() or not embedded:
            raise KeyboardInterrupt
        interrupted.set()
        print("\ncancelling: the trainer saves a checkpoint first (Ctrl-C again to leave now)")
        threading.Thread(target=client.cancel, args=(job.id,), daemon=True).start()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        job = follow(client, job.id, LiveView())
    except KeyboardInterrupt:
        print(f"\nstopped following {job.id}" + ("" if embedded else "; it keeps running"))
        return ExitCode.CANCELLED
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_CODES[job.state]


if __name__ == "__main__":
    sys.exit(main())
