"""`kitchen` commands that need no launcher: the MLflow UI, importing a run, diffing two runs.

kitchen mlflow [--state-dir DIR] [--port 5000]   the MLflow UI on 127.0.0.1 over the
                                                 launcher's embedded store
kitchen track import RUN_DIR [--config JOB.yaml] [--uri URI]
                                                 a finished run's metrics.jsonl into MLflow
kitchen diff RUN_A RUN_B [--config-a Y] [--config-b Y]
                                                 what differs, and where the losses part
"""

import argparse
import contextlib
import os
import sys

from launcher.settings import embedded_tracking_uri
from launcher.tracking import records
from launcher.tracking.spool import Batch
from protos.paths import state_dir, tracking_dir, user_path

DEFAULT_UI_PORT = 5000


def ui_command(state: str, port: int) -> list[str]:
    """`mlflow server` over the embedded store, on loopback only (the store holds every
    team's runs: a shared launcher's runs belong behind a configured tracking server)."""
    mlflow_dir = tracking_dir(state)
    return [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", embedded_tracking_uri(state),
        "--default-artifact-root", os.path.join(mlflow_dir, "artifacts"),
    ]  # fmt: skip


@contextlib.contextmanager
def _mlflow_errors(uri: str):
    """MLflow's own errors (a server down, a refused request) as an OSError naming the store,
    which `kitchen` prints as one line."""
    try:
        yield
    except (ValueError, OSError):
        raise
    except Exception as err:  # noqa: BLE001 (MlflowException and whatever its client raises)
        first = str(err).splitlines()[0][:300] if str(err) else ""
        raise OSError(f"MLflow at {uri}: {type(err).__name__}: {first}") from err


def cmd_mlflow(args, out) -> int:
    state = user_path(args.state_dir) if args.state_dir else state_dir()
    if not os.path.isdir(tracking_dir(state)):
        print(
            f"kitchen mlflow: no MLflow store in {tracking_dir(state)} yet (a launcher with this "
            "state dir writes it when its first job starts); starting on an empty one",
            file=sys.stderr,
        )
        os.makedirs(tracking_dir(state), exist_ok=True)
    print(
        f"MLflow UI serving on http://127.0.0.1:{args.port} (store {tracking_dir(state)})", file=out
    )
    out.flush()
    command = ui_command(state, args.port)
    os.execv(command[0], command)
    return 0  # not reached


def cmd_track_import(args, out) -> int:
    from launcher.tracking.run_dir import read_run  # noqa: PLC0415
    from launcher.tracking.sink import MlflowSink  # noqa: PLC0415 (imports mlflow: seconds)

    state = user_path(args.state_dir) if args.state_dir else state_dir()
    uri = args.uri or embedded_tracking_uri(state)
    run = read_run(user_path(args.run_dir), user_path(args.config) if args.config else "")
    for warning in run.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    job = run.job
    tags = {**records.job_tags(job), **records.run_dir_tags(job.run_dir)}
    params = records.spec_params(job.spec)
    batch = Batch(
        job.id, records.experiment_name(job.spec.team), tags, params, run.points,
        records.run_artifacts(job.run_dir), {"config/job_spec.json": params},
        status="FINISHED" if job.state else "",
    )  # fmt: skip
    os.makedirs(tracking_dir(state), exist_ok=True)
    with _mlflow_errors(uri):
        run_id = MlflowSink(uri, state).send(batch)
    steps = len({p.step for p in run.points})
    print(
        f"imported {job.run_dir}: {len(run.points)} values over {steps} steps, {len(params)} "
        f"params -> {uri} experiment {batch.experiment}, run {run_id}",
        file=out,
    )
    return 0


def cmd_diff(args, out) -> int:
    from launcher.tracking import diff  # noqa: PLC0415
    from launcher.tracking.run_dir import read_run  # noqa: PLC0415

    a = read_run(user_path(args.run_a), user_path(args.config_a) if args.config_a else "")
    b = read_run(user_path(args.run_b), user_path(args.config_b) if args.config_b else "")
    text = diff.render(diff.compare(a, b))
    out.write(text)
    if args.note:  # B's run page shows it (MLflow renders a run's note as Markdown)
        from launcher.tracking.sink import MlflowSink  # noqa: PLC0415 (imports mlflow)

        state = user_path(args.state_dir) if args.state_dir else state_dir()
        uri = args.uri or embedded_tracking_uri(state)
        with _mlflow_errors(uri):
            sink = MlflowSink(uri, state)
            run = sink.run_id(Batch(b.job.id, records.experiment_name(b.job.spec.team)), False)
        if run is None:
            raise FileNotFoundError(
                f"run B ({b.job.id}) is not in MLflow at {uri}: `kitchen track import` it first"
            )
        note = f"`kitchen diff` against {a.job.id} ({a.job.run_dir}):\n\n```\n{text}```\n"
        with _mlflow_errors(uri):
            sink.client.set_tag(run, "mlflow.note.content", note)
        print(f"noted on run {run} ({uri})", file=out)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    ui = sub.add_parser("mlflow", help="the MLflow UI over the launcher's embedded store")
    ui.add_argument("--state-dir", help="the launcher's state dir (default $KITCHEN_STATE_DIR)")
    ui.add_argument("--port", type=int, default=DEFAULT_UI_PORT)
    ui.set_defaults(run=cmd_mlflow, local=True)
    track = sub.add_parser("track", help="MLflow tracking of runs")
    track_sub = track.add_subparsers(dest="track_command", required=True)
    imp = track_sub.add_parser("import", help="send a finished run's metrics.jsonl to MLflow")
    imp.add_argument("run_dir")
    imp.add_argument("--config", help="the job YAML of a run started by hand")
    imp.add_argument("--uri", help="MLflow tracking URI (default: the embedded store)")
    imp.add_argument("--state-dir", help="whose embedded store (default $KITCHEN_STATE_DIR)")
    imp.set_defaults(run=cmd_track_import, local=True)
    d = sub.add_parser("diff", help="what differs between two runs, and where the losses part")
    d.add_argument("run_a")
    d.add_argument("run_b")
    d.add_argument("--config-a", help="the job YAML of run A, if started by hand")
    d.add_argument("--config-b", help="the job YAML of run B, if started by hand")
    d.add_argument("--note", action="store_true", help="also write it on run B's MLflow page")
    d.add_argument("--uri", help="MLflow tracking URI for --note (default: the embedded store)")
    d.add_argument("--state-dir", help="whose embedded store (default $KITCHEN_STATE_DIR)")
    d.set_defaults(run=cmd_diff, local=True)
