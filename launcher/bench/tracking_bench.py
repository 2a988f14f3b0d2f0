"""What MLflow tracking costs a training job: its step time with tracking on beside off.

    bazel run //launcher/bench:tracking_bench -- [--rounds 3] [--steps N] \
        [--out launcher/bench/tracking_results.md]

Two launchers in this process, on one machine at once: one writing every job to its embedded
MLflow store (the default: `tracking.uri` ""), one with `tracking.uri: none`. The main job
(configs/guide_pretrain.yaml, reporting every step, `log_every: 1`: the most tracking traffic
a job makes) runs on each in turn, in ABBA order over --rounds rounds, one job at a time, and
the trainer's own step times (metrics.jsonl, `step_time_seconds`, the first step left out)
are compared: medians per side, and the ratio. Before the rounds each launcher runs a short
warm-up job (MLflow's import and store tables, the precook cache). The tracked jobs' runs are
then read back from MLflow, so the benchmark shows that tracking did its work.

On a shared machine the step times move with the other sessions' load far more than 1%, so
the benchmark also reads what tracking itself costs: the CPU time of the tracking launcher's
`kitchen-tracking` thread (Linux: /proc/self/task/<tid>/stat) over the rounds, against the
tracked jobs' wall time: the share of one core the writer took while they trained.
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
from protos import job_pb2, launcher_pb2
from protos.paths import user_path
from protos.progress_log import is_training_step, read_progress_log

MAIN_JOB = "configs/guide_pretrain.yaml"
FINAL = (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED)


def workspace_file(path: str) -> str:
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
    return os.path.join(root, path)


def launcher(state: str, tracked: int) -> Launcher:
    cfg = launcher_pb2.LauncherConfig(listen="127.0.0.1:0", metrics_listen="none", state_dir=state)
    cfg.tracking.uri = "" if tracked else "none"
    return Launcher(cfg).start()


def thread_cpu_seconds(name: str) -> float:
    """User + system CPU seconds of this process's thread `name` so far."""
    (thread,) = [t for t in threading.enumerate() if t.name == name]
    with open(f"/proc/self/task/{thread.native_id}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds (2 jobs each)")
    p.add_argument("--steps", type=int, help="train.steps of the main job (default: its own)")
    p.add_argument("--out", help="also append the results (Markdown) to this file")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="tracking_bench-")
    spec = load_spec(workspace_file(MAIN_JOB))
    spec.trainer.train.log_every = 1
    if args.steps:
        spec.trainer.train.steps = args.steps
    spec.trainer.data.cache_dir = os.path.join(root, "precook")  # one precook for both
    warmup = job_pb2.JobSpec()
    warmup.CopyFrom(spec)
    warmup.name, warmup.trainer.train.steps = "warmup", 5
    warmup.trainer.train.eval_every = warmup.trainer.checkpoint.every_steps = 0
    machine_at_start = machine()  # the load before the jobs add their own
    launchers = {tracked: launcher(os.path.join(root, str(tracked)), tracked) for tracked in (1, 0)}
    clients = {tracked: Client(x.address) for tracked, x in launchers.items()}
    times: dict[int, list[float]] = {1: [], 0: []}
    medians: dict[int, list[float]] = {1: [], 0: []}
    tracked_jobs = []
    started = time.time()
    try:
        for tracked in (1, 0):
            run_job(clients[tracked], warmup)
        cpu_before, tracked_wall = thread_cpu_seconds("kitchen-tracking"), 0.0
        for r in range(args.rounds):
            for tracked in (1, 0) if r % 2 == 0 else (0, 1):
                job_started = time.monotonic()
                job = run_job(clients[tracked], spec)
                tracked_wall += (time.monotonic() - job_started) if tracked else 0.0
                steps = step_times(job)
                times[tracked] += steps
                medians[tracked].append(statistics.median(steps))
                if tracked:
                    tracked_jobs.append(job)
                side = "on " if tracked else "off"
                median = 1000 * medians[tracked][-1]
                print(f"round {r + 1} tracking {side}: median step {median:.1f} ms", flush=True)
        tracker = launchers[1].tracker
        assert tracker is not None
        deadline = time.monotonic() + 300
        while tracker.spool.pending() and time.monotonic() < deadline:
            time.sleep(0.5)
        tracking_cpu = thread_cpu_seconds("kitchen-tracking") - cpu_before
    finally:
        for tracked in (1, 0):
            clients[tracked].close()
            launchers[tracked].stop()
    mlflow = MlflowClient(embedded_tracking_uri(os.path.join(root, "1")))
    experiment = mlflow.get_experiment_by_name("kitchen/default")
    assert experiment is not None
    runs = {
        r.data.tags["kitchen.job_id"]: r for r in mlflow.search_runs([experiment.experiment_id])
    }
    logged = [len(mlflow.get_metric_history(runs[j.id].info.run_id, "loss")) for j in tracked_jobs]
    on, off = statistics.median(times[1]), statistics.median(times[0])
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC, tracking on beside off",
        "",
        f"Run on {machine_at_start}. Command: `bazel run //launcher/bench:tracking_bench -- "
        f"--rounds {args.rounds}{f' --steps {args.steps}' if args.steps else ''}`. Main job: "
        f"{MAIN_JOB} with log_every 1 "
        f"({spec.trainer.train.steps} steps, each reported), {args.rounds} jobs per side in ABBA "
        f"order; MLflow received every tracked step: {logged} loss values.",
        "",
        "| tracking | jobs | steps | median step | per-job medians |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for tracked, name in ((1, "on (embedded store)"), (0, "off (`tracking.uri: none`)")):
        per_job = ", ".join(f"{1000 * m:.1f}" for m in medians[tracked])
        lines.append(
            f"| {name} | {len(medians[tracked])} | {len(times[tracked])} | "
            f"{1000 * statistics.median(times[tracked]):.1f} ms | {per_job} ms |"
        )
    lines += [
        "",
        f"Ratio on / off (median step): {on / off:.3f} ({100 * (on / off - 1):+.1f}%).",
        "",
        f"The tracking thread's own CPU time over the rounds (its sends of every tracked job, "
        f"until the spool was empty): {tracking_cpu:.2f} s, against {tracked_wall:.0f} s of "
        f"tracked jobs (submit to end): {100 * tracking_cpu / tracked_wall:.2f}% of one core.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(user_path(args.out), "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
