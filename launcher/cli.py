"""`kitchen`: look at and steer the launcher's jobs.

    kitchen [--launcher ADDR] [--token T] [--tls-ca PEM] list [--state running ...] [--team T]
    kitchen status JOB        everything about one job
    kitchen watch JOB         live table until it ends (exit code: the job's outcome)
    kitchen logs JOB [-f]     the trainer's output, every attempt; -f follows
    kitchen cancel JOB        stops it (the trainer saves a checkpoint first)
    kitchen mlflow            the MLflow UI on 127.0.0.1:5000 over the launcher's own store
    kitchen track import RUN_DIR   a finished run (its metrics.jsonl) into MLflow
    kitchen diff RUN_A RUN_B  what decides the two runs, side by side; where their losses part

The launcher address defaults to $KITCHEN_LAUNCHER or 127.0.0.1:50051 (several replicas:
comma-separated, tried in turn when one is unavailable); the token to
$KITCHEN_TOKEN; the TLS root certificate to $KITCHEN_TLS_CA.
"""

import argparse
import sys
import time

import grpc

from launcher.client import Client
from launcher.live_view import EXIT_CODES, LiveView, duration, follow, rate, serving
from launcher.tracking.commands import add_commands
from protos import job_pb2
from protos.enums import enum_name

LIST_COLUMNS = (
    ("ID", 8), ("NAME", 18), ("KIND", 9), ("STATE", 10), ("TEAM", 10), ("POOL", 8),
    ("TRIES", 6), ("STEP", 12), ("LOSS", 8), ("AGE", 9),
)  # fmt: skip


def _seconds_since(ts) -> float:
    return time.time() - ts.ToNanoseconds() / 1e9


def _kind(job) -> str:
    return enum_name(job.spec, "kind").lower()  # total: a kind outside the enum shows as its number


def cmd_list(client, args, out):
    states = [job_pb2.JobState.Value(s.upper()) for s in args.state or []]
    shown, token = 0, ""
    print("".join(name.ljust(w) for name, w in LIST_COLUMNS).rstrip(), file=out)
    while shown < args.limit:
        page = client.list(
            states=states, team=args.team or "", owner=args.owner or "",
            page_size=min(100, args.limit - shown), page_token=token,
        )  # fmt: skip
        for job in page.jobs:
            p = job.progress
            cells = [
                job.id, job.spec.name[:17], _kind(job), job_pb2.JobState.Name(job.state),
                job.spec.team[:9] or "-", job.pool, str(job.attempts),
                f"{p.step}/{p.total_steps}" if p.total_steps else "-",
                f"{p.loss:.3f}" if p.step else "-", duration(_seconds_since(job.created)),
            ]  # fmt: skip
            print(
                "".join(c.ljust(w) for c, (_, w) in zip(cells, LIST_COLUMNS, strict=True)).rstrip(),
                file=out,
            )
        shown += len(page.jobs)
        token = page.next_page_token
        if not token:
            break
    if token:
        print(f"(showing the newest {shown}; --limit N for more)", file=out)
    return 0


def cmd_status(client, args, out):
    job = client.get(args.job)
    s, p = job.spec, job.progress
    r = s.resources
    lines = [
        f"{job.id}  {s.name}  ({_kind(job)})",
        f"  state       {job_pb2.JobState.Name(job.state)}"
        + (f" - stopping ({job_pb2.StopReason.Name(job.stop)})" if job.stop else ""),
        f"  owner/team  {s.owner or '-'} / {s.team or '-'}   priority {s.priority}",
        f"  resources   pool {job.pool}, {r.nodes or 1} node(s) x {r.gpus_per_node} GPU(s), "
        f"{r.processes_per_node or 1} process(es) per node",
        f"  attempts    {job.attempts} ({job.failures} failed, {job.preemptions} preempted)",
    ]
    if job.waiting_reason:
        lines.append(f"  waiting     {job.waiting_reason}")
    if job.exit_reason:
        lines.append(f"  reason      {job.exit_reason}")
    for label, ts in (
        ("created", job.created),
        ("started", job.started),
        ("finished", job.finished),
    ):
        if ts.seconds:
            lines.append(
                f"  {label:<11} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts.seconds))}"
            )
    if p.step:
        lines.append(
            f"  progress    step {p.step}/{p.total_steps}, loss {p.loss:.4f}, "
            f"{rate(p.tokens_per_second)}, MFU {100 * p.mfu:.1f}% ({p.mfu_basis or '?'}), "
            f"goodput {100 * p.goodput:.0f}%, {p.tokens_total:,} tokens"
        )
        if job.last_progress.seconds:
            lines.append(f"  last report {duration(_seconds_since(job.last_progress))} ago")
    if p.precook_tasks_total:  # #21: a PRECOOK job run as tasks
        lines.append(f"  tasks       {p.precook_tasks_done}/{p.precook_tasks_total} done")
    if serving(job):
        lines.append(f"  serving     {serving(job)}")
    lines.append(f"  run dir     {job.run_dir}")
    print("\n".join(lines), file=out)
    return 0


def cmd_watch(client, args, out):
    job = follow(client, args.job, LiveView(out))
    return EXIT_CODES[job.state]


def cmd_logs(client, args, out):
    stream = getattr(out, "buffer", None)
    for chunk in client.logs(args.job, follow=args.follow):
        if stream is not None:
            stream.write(chunk.data)
            stream.flush()
        else:
            out.write(chunk.data.decode(errors="replace"))
    return 0


def cmd_cancel(client, args, out):
    job = client.cancel(args.job)
    state = job_pb2.JobState.Name(job.state)
    if job.stop == job_pb2.STOP_CANCEL:
        saves = "the trainer saves a checkpoint"
        if job.spec.kind == job_pb2.SERVE:
            saves = "the server finishes its open requests"
        print(
            f"{job.id}: stopping ({saves}); `kitchen watch {job.id}`",
            file=out,
        )
    else:
        print(f"{job.id}: {state}", file=out)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kitchen", description=__doc__.split("\n")[0])
    p.add_argument(
        "--launcher",
        help="address, or replicas' addresses comma-separated (default $KITCHEN_LAUNCHER or "
        "127.0.0.1:50051)",
    )
    p.add_argument("--token", help="bearer token (default $KITCHEN_TOKEN)")
    p.add_argument("--tls-ca", help="PEM root certificate (default $KITCHEN_TLS_CA)")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="jobs, newest first")
    ls.add_argument(
        "--state", action="append", choices=[s.lower() for s in job_pb2.JobState.keys()[1:]]
    )
    ls.add_argument("--team")
    ls.add_argument("--owner")
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(run=cmd_list)
    for name, run, text in (
        ("status", cmd_status, "everything about one job"),
        ("watch", cmd_watch, "live table until the job ends"),
        ("logs", cmd_logs, "the trainer's output"),
        ("cancel", cmd_cancel, "stop a job"),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("job")
        c.set_defaults(run=run)
        if name == "logs":
            c.add_argument("-f", "--follow", action="store_true")
    add_commands(sub)  # launcher/tracking/commands.py: need no launcher
    return p


def main(argv=None, out=sys.stdout) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "local", False):
        try:
            return args.run(args, out)
        except (ValueError, OSError) as e:  # ConfigError, RunDirError, ProgressLogError, ...
            print(f"kitchen {args.command}: {e}", file=sys.stderr)
            return 2
    client = Client(args.launcher, args.token, args.tls_ca)
    try:
        return args.run(client, args, out)
    except grpc.RpcError as e:
        print(f"kitchen {args.command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
