"""What MLflow tracking costs a training job: its step time with tracking on beside off.

    bazel run //launcher/bench:tracking_bench -- [--pairs 8] [--steps N] [--log-every N] \
        [--out launcher/bench/tracking_results.md]

Two launchers in this process, on one machine at once: one writing every job to its embedded
MLflow store (the default: `tracking.uri` ""), one with `tracking.uri: none`. The main job
(configs/tiny.yaml, the README's first command, as it is configured: `log_every` 10 by default;
`--log-every 1` reports every step, the most tracking traffic a job makes) runs as many jobs,
interleaved on/off in pairs, each pair's order the reverse of the last (ABBA ABBA ...: a drift
of the machine's load over a pair cancels), one job at a time. Each pair gives one ratio of the
trainer's own median step times (metrics.jsonl, `step_time_seconds`, the first step left out);
the result is the median of the pairs' ratios with its quartiles and range. Before the pairs
each launcher runs a short warm-up job (MLflow's import and store tables, the precook cache).
The tracked jobs' runs are then read back from MLflow, so the benchmark shows that tracking did
its work.

On a shared machine the step times move with the other sessions' load, so the benchmark also
measures what tracking itself costs, which that load does not change: the CPU seconds of the
tracking launcher's writer thread (`kitchen-tracking`: spooling and sending, until each
tracked job's spool is empty) and of the controller's `Tracker.progress` calls (the thread
CPU clock around each), per training step, against the step time.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

from mlflow.tracking import MlflowClient

from launcher.bench.machine import machine
from launcher.client import Client
from launcher.server import Launcher
from launcher.settings import embedded_tracking_uri
from launcher.submit import load_spec
from launcher.tracking import records
from launcher.tracking.tracker import Tracker
from protos import job_pb2, launcher_pb2, progress_pb2
from protos.defaults import with_defaults
from protos.paths import user_path
from protos.progress_log import is_training_step, read_progress_log

MAIN_JOB = "configs/tiny.yaml"
FINAL = (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED)


def workspace_file(path: str) -> str:
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
    return os.path.join(root, path)


def launcher(state: str, tracked: int) -> Launcher:
    cfg = launcher_pb2.LauncherConfig(listen="127.0.0.1:0", metrics_listen="none", state_dir=state)
    cfg.tracking.uri = "" if tracked else "none"
    return Launcher(cfg).start()


def thread_cpu_seconds(name: str) -> float:
    """User + system CPU seconds of this process's thread `name` so far (its CPU clock)."""
    (thread,) = [t for t in threading.enumerate() if t.name == name]
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class ProgressClock:
    """The CPU time the controller's threads spend in `tracker.progress` (memory appends)."""

    def __init__(self, tracker: Tracker):
        self.seconds = 0.0
        self._lock = threading.Lock()
        inner = tracker.progress

        def progress(job, report):
            start = time.thread_time()
            try:
                inner(job, report)
            finally:
                with self._lock:
                    self.seconds += time.thread_time() - start

        tracker.progress = progress  # type: ignore[method-assign]


def run_job(client: Client, spec: job_pb2.JobSpec) -> job_pb2.Job:
    job = client.submit(spec)
    while (job := client.get(job.id)).state not in FINAL:
        time.sleep(0.2)
    if job.state != job_pb2.SUCCEEDED:
        sys.exit(f"{job.id} ended {job_pb2.JobState.Name(job.state)}: {job.exit_reason}")
    return job


def step_times(job: job_pb2.Job) -> list[float]:
    records = [r for r in read_progress_log(job.run_dir).records if is_training_step(r)]
    return [r.step_time_seconds for r in records if r.step > 1]


def drained(tracker: Tracker, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while tracker.spool.pending() or tracker._buffer:  # noqa: SLF001 (what is not yet spooled)
        if time.monotonic() > deadline:
            sys.exit(f"tracking: spool not empty after {timeout:.0f} s")
        time.sleep(0.1)


def spread(values: list[float]) -> str:
    """'median (quartiles q1-q3, range lo-hi)'."""
    if len(values) < 2:
        return f"{values[0]:.3f} (one pair)"
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{q2:.3f} (quartiles {q1:.3f}-{q3:.3f}, range {min(values):.3f}-{max(values):.3f})"


def writer_costs(root: str, repeats: int = 5) -> list[str]:
    """The writer's CPU (this thread's clock around the tracker's own calls, with no thread of
    its own: the same code) for a job's start, one flush of n steps, and the end, into a fresh
    embedded store: how its per-step cost splits into per-job, per-flush and per-value parts."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    state = os.path.join(root, "writer")
    cfg = launcher_pb2.LauncherConfig(state_dir=state)
    cfg.tracking.uri, cfg.tracking.spool_max_bytes = embedded_tracking_uri(state), 1 << 30
    tracker = Tracker(cfg, CollectorRegistry())
    spec = load_spec(workspace_file(MAIN_JOB))
    step = 0

    def timed(call) -> float:
        start = time.thread_time()
        call()
        if tracker.drain() < 1 or tracker.spool.pending():
            sys.exit("tracking: a batch was not sent")
        return time.thread_time() - start

    def flush(job: job_pb2.Job, n: int) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            tracker.progress(job, progress_pb2.Progress(
                job_id=job.id, phase="train", step=step, loss=4 - step / 1e4, lr=3e-4,
                grad_norm=0.9, step_time_seconds=0.1, tokens_per_second=1e4,
                tokens_total=step * 1024, mfu=0.01, peak_memory_bytes=1 << 30,
                padding_fraction=0.01,
            ))  # fmt: skip
        tracker._flush_buffer()  # noqa: SLF001 (what the thread does every flush_seconds)

    costs: dict[str, list[float]] = {}
    params = len(records.spec_params(spec))
    for i in range(repeats + 1):  # the first: MLflow's import and the store's tables
        job = job_pb2.Job(id=f"w{i}", spec=spec, run_dir=os.path.join(root, f"w{i}"))
        job.state = job_pb2.SUCCEEDED
        samples = {
            f"start (run, {params} params, tags, config)": timed(
                lambda j=job: tracker.job_started(j)
            )
        }
        for n in (1, 10, 100):
            samples[f"one flush of {n} steps"] = timed(lambda j=job, n=n: flush(j, n))
        samples["end (status)"] = timed(lambda j=job: tracker.job_ended(j))
        for name, seconds in samples.items():
            if i:
                costs.setdefault(name, []).append(seconds)
    lines = ["| writer call | CPU, median of 5 |", "| --- | ---: |"]
    lines += [f"| {k} | {1000 * statistics.median(v):.1f} ms |" for k, v in costs.items()]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=8, help="on/off pairs of jobs, orders alternating")
    p.add_argument("--steps", type=int, help="train.steps of each job (default: the config's)")
    p.add_argument(
        "--log-every", type=int, help="train.log_every (default: the config's; 1 = every step)"
    )
    p.add_argument("--out", help="also append the results (Markdown) to this file")
    p.add_argument("--writer-costs", action="store_true", help="only the writer's CPU per call")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="tracking_bench-")
    if args.writer_costs:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        lines = [
            f"## {when} UTC, the writer's CPU per call",
            "",
            f"Run on {machine()}. Command: "
            "`bazel run //launcher/bench:tracking_bench -- --writer-costs`; 9 series per "
            "step (the trainer's pretraining fields), into the embedded SQLite store.",
            "",
        ]
        text = "\n".join(lines + writer_costs(root)) + "\n"
        print(text)
        if args.out:
            with open(user_path(args.out), "a", encoding="utf-8") as f:
                f.write("\n" + text)
        return
    spec = load_spec(workspace_file(MAIN_JOB))
    if args.log_every:
        spec.trainer.train.log_every = args.log_every
    if args.steps:
        spec.trainer.train.steps = args.steps
    resolved = with_defaults(spec.trainer).train
    steps_per_job, log_every = resolved.steps, resolved.log_every
    spec.trainer.data.cache_dir = os.path.join(root, "precook")  # one precook for both
    warmup = job_pb2.JobSpec()
    warmup.CopyFrom(spec)
    warmup.name, warmup.trainer.train.steps = "warmup", 5
    warmup.trainer.train.eval_every = warmup.trainer.checkpoint.every_steps = 0
    machine_at_start = machine()  # the load before the jobs add their own
    launchers = {tracked: launcher(os.path.join(root, str(tracked)), tracked) for tracked in (1, 0)}
    clients = {tracked: Client(x.address) for tracked, x in launchers.items()}
    tracker = launchers[1].tracker
    assert tracker is not None
    clock = ProgressClock(tracker)
    pairs: list[dict[int, float]] = []  # per pair: tracked -> median step
    tracked_jobs, tracked_steps, writer_cpu, progress_cpu = [], 0, 0.0, 0.0
    started = time.time()
    try:
        for tracked in (1, 0):
            run_job(clients[tracked], warmup)
        drained(tracker)
        for i in range(args.pairs):
            pair: dict[int, float] = {}
            for tracked in (1, 0) if i % 2 == 0 else (0, 1):
                cpu, in_progress = thread_cpu_seconds("kitchen-tracking"), clock.seconds
                job = run_job(clients[tracked], spec)
                steps = step_times(job)
                pair[tracked] = statistics.median(steps)
                if tracked:
                    time.sleep(2 * tracker.flush_seconds)  # the job's end, handed over just after
                    drained(tracker)
                    writer_cpu += thread_cpu_seconds("kitchen-tracking") - cpu
                    progress_cpu += clock.seconds - in_progress
                    tracked_steps += steps_per_job
                    tracked_jobs.append(job)
            pairs.append(pair)
            print(
                f"pair {i + 1}: on {1000 * pair[1]:.1f} ms, off {1000 * pair[0]:.1f} ms, "
                f"ratio {pair[1] / pair[0]:.3f}",
                flush=True,
            )
    finally:
        for tracked in (1, 0):
            clients[tracked].close()
            launchers[tracked].stop()
    machine_at_end = machine()
    mlflow = MlflowClient(embedded_tracking_uri(os.path.join(root, "1")))
    experiment = mlflow.get_experiment_by_name("kitchen/default")
    assert experiment is not None
    runs = {
        r.data.tags["kitchen.job_id"]: r for r in mlflow.search_runs([experiment.experiment_id])
    }
    logged = [len(mlflow.get_metric_history(runs[j.id].info.run_id, "loss")) for j in tracked_jobs]
    ratios = [pair[1] / pair[0] for pair in pairs]
    step_on = statistics.median(pair[1] for pair in pairs)
    cpu_per_step = (writer_cpu + progress_cpu) / tracked_steps
    given = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"bazel run //launcher/bench:tracking_bench{' -- ' + given if given else ''}"
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC, tracking on beside off, "
        f"{args.pairs} interleaved pairs",
        "",
        f"Run on {machine_at_start} (at the end: load average "
        f"{machine_at_end.split('average ')[1]}). Command: `{command}`. Main job: {MAIN_JOB}, "
        f"{steps_per_job} steps, log_every {log_every}; pairs in alternating order "
        f"(on,off / off,on / ...), one job at a time; MLflow received every reported step: "
        f"{sum(logged)} loss values for {len(tracked_jobs)} jobs x {steps_per_job} steps.",
        "",
        "| pair | order | median step, on | median step, off | on / off |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for i, pair in enumerate(pairs):
        order = "on, off" if i % 2 == 0 else "off, on"
        lines.append(
            f"| {i + 1} | {order} | {1000 * pair[1]:.1f} ms | {1000 * pair[0]:.1f} ms | "
            f"{pair[1] / pair[0]:.3f} |"
        )
    lines += [
        "",
        f"Step time on / off, median of the pairs' ratios: {spread(ratios)}.",
        "",
        f"CPU that tracking itself used, over {len(tracked_jobs)} tracked jobs "
        f"({tracked_steps} training steps): writer thread {writer_cpu:.3f} s, "
        f"`Tracker.progress` calls {progress_cpu:.3f} s; {1000 * cpu_per_step:.3f} ms per "
        f"training step, against a median step of {1000 * step_on:.1f} ms: "
        f"{100 * cpu_per_step / step_on:.2f}% of one core's time per step.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(user_path(args.out), "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
