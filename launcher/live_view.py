"""A compact live table of one job, fed by WatchJob updates.

    STATE      STEP             LOSS      THROUGHPUT     MFU      ETA
    RUNNING    120/200 (60%)    3.412     4.1k tok/s     1.2%     0:42

On a terminal the row is redrawn in place; in a log file a row is printed at most every few
seconds. State changes and the trainer's messages (checkpoint saved, resumed, ...) are
printed as lines of their own, so the story of the run stays readable afterwards.
"""

import os
import sys
import time

import grpc

from protos import job_pb2
from protos.attempt_file import OUTPUT_LOG, attempt_dir
from protos.exit_codes import ExitCode

# What `submit` and `kitchen watch` exit with when the job ends in each final state.
EXIT_CODES = {
    job_pb2.SUCCEEDED: ExitCode.OK,
    job_pb2.FAILED: ExitCode.FAILED,
    job_pb2.CANCELLED: ExitCode.CANCELLED,
}
FINAL = tuple(EXIT_CODES)
COLUMNS = (("STATE", 10), ("STEP", 17), ("LOSS", 9), ("THROUGHPUT", 14), ("MFU", 8), ("ETA", 9))
PLAIN_ROW_EVERY_SECONDS = 5.0


def duration(seconds: float) -> str:
    """4 s, 3:05, 1:02:03 (h:mm:ss)."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def rate(tokens_per_second: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_second >= scale:
            return f"{tokens_per_second / scale:.1f}{unit} tok/s"
    return f"{tokens_per_second:.0f} tok/s"


def state_name(job) -> str:
    return job_pb2.JobState.Name(job.state)


def row(job: job_pb2.Job) -> list[str]:
    p = job.progress
    step = loss = throughput = mfu = eta = "-"
    if p.total_steps:
        step = f"{p.step}/{p.total_steps} ({100 * p.step // p.total_steps}%)"
        if p.step_time_seconds and job.state == job_pb2.RUNNING:
            eta = duration((p.total_steps - p.step) * p.step_time_seconds)
    elif p.step:
        step = str(p.step)
    if p.step:
        loss = f"{p.loss:.3f}"
        throughput = rate(p.tokens_per_second) if p.tokens_per_second else "-"
        mfu = f"{100 * p.mfu:.1f}%" if p.mfu else "-"
    return [state_name(job), step, loss, throughput, mfu, eta]


def serving(job: job_pb2.Job) -> str:
    """A serve job's endpoint and load ("" for other kinds, or before it listens)."""
    p = job.progress
    if job.spec.kind != job_pb2.SERVE or not p.endpoint or job.state != job_pb2.RUNNING:
        return ""
    blocks = p.kv_blocks_used + p.kv_blocks_free
    return (
        f"{p.endpoint}/v1: {p.running_requests} running, {p.waiting_requests} waiting, "
        f"KV blocks {p.kv_blocks_used}/{blocks}, {rate(p.generated_tokens_per_second)}, "
        f"{p.requests_finished:,} requests served"
    )


def table(rows) -> list[str]:
    out = []
    for cells in rows:
        out.append("".join(c.ljust(w) for c, (_, w) in zip(cells, COLUMNS, strict=True)).rstrip())
    return out


class LiveView:
    def __init__(self, out=sys.stdout, interactive=None, clock=time.monotonic):
        self.out = out
        self.interactive = out.isatty() if interactive is None else interactive
        self.clock = clock
        self._state = None
        self._attempt = 0
        self._message = ""
        self._waiting = ""
        self._endpoint = ""
        self._row = None
        self._row_printed_at = -1e9
        self._header_printed = False

    def _line(self, text: str):
        if self.interactive and self._row is not None:
            self.out.write("\r\x1b[K")
        self.out.write(text + "\n")
        self._row = None if self.interactive else self._row
        self.out.flush()

    def update(self, job: job_pb2.Job):
        stamp = time.strftime("%H:%M:%S")
        if job.state != self._state or job.attempts != self._attempt:
            what = state_name(job)
            if job.attempts > 1 and job.state in (job_pb2.STARTING, job_pb2.RUNNING):
                what += f" (attempt {job.attempts})"
            if job.exit_reason and job.state in (job_pb2.QUEUED, job_pb2.PREEMPTED):
                what += f": {job.exit_reason}"
            self._line(f"[{stamp}] {job.id} {what}")
            if job.state == job_pb2.RUNNING and job.run_dir:
                output = os.path.join(attempt_dir(job.run_dir, job.attempts), OUTPUT_LOG)
                self._line(f"[{stamp}] trainer output (precook, steps, errors): {output}")
            self._state, self._attempt = job.state, job.attempts
        if job.waiting_reason and job.waiting_reason != self._waiting:
            self._line(f"[{stamp}] waiting: {job.waiting_reason}")
        self._waiting = job.waiting_reason
        if job.progress.message and job.progress.message != self._message:
            self._line(f"[{stamp}] {job.progress.message}")
        self._message = job.progress.message
        if serving(job) and job.progress.endpoint != self._endpoint:
            self._line(f"[{stamp}] serving at {job.progress.endpoint}/v1 (OpenAI API)")
            self._endpoint = job.progress.endpoint
        if job.state in (job_pb2.RUNNING, job_pb2.STARTING) and job.progress.step:
            self._draw(row(job))

    def _draw(self, cells):
        if not self._header_printed:
            self._line(table([[name for name, _ in COLUMNS]])[0])
            self._header_printed = True
        text = table([cells])[0]
        if self.interactive:
            self.out.write("\r\x1b[K" + text)
            self._row = text
        elif text != self._row and self.clock() - self._row_printed_at >= PLAIN_ROW_EVERY_SECONDS:
            self.out.write(text + "\n")
            self._row, self._row_printed_at = text, self.clock()
        self.out.flush()

    def finish(self, job: job_pb2.Job):
        """The last word: outcome, final numbers, where the results are."""
        if self.interactive and self._row is not None:
            self.out.write("\n")
        elif not self.interactive and job.progress.step:
            self.out.write(table([row(job)])[0] + "\n")
        took = ""
        if job.HasField("started") and job.HasField("finished"):
            ran = job.finished.ToNanoseconds() - job.started.ToNanoseconds()
            took = f" in {duration(ran / 1e9)}"
        why = f": {job.exit_reason}" if job.state != job_pb2.SUCCEEDED else ""
        self.out.write(f"{job.id} {state_name(job)}{took}{why}\n")
        p = job.progress
        if p.step:
            self.out.write(f"  final loss {p.loss:.3f} at step {p.step}")
            if p.eval_loss:
                self.out.write(f", eval loss {p.eval_loss:.3f}")
            self.out.write(f"; {p.tokens_total:,} tokens; attempts {job.attempts}\n")
        if job.run_dir:
            self.out.write(f"  run dir: {job.run_dir}\n")
            plot = os.path.join(job.run_dir, "loss.png")
            if os.path.exists(plot):
                self.out.write(f"  loss curve: {plot}\n")
        self.out.flush()


def follow(client, job_id: str, view: LiveView) -> job_pb2.Job:
    """Watches the job until it ends; rides out a launcher restart (or a replica's failure)
    by reconnecting."""
    job, warned = None, False
    while job is None or job.state not in FINAL:
        try:
            for job in client.watch(job_id):
                view.update(job)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise
            client.next_replica()  # with several replicas' addresses: the next one
            if not warned:
                view.out.write(f"launcher unreachable ({e.code().name}); reconnecting...\n")
                warned = True
            time.sleep(1.0)
    view.finish(job)
    return job
