"""How fast the launcher answers and schedules, measured on this machine in one run.

    bazel run //launcher/bench:launcher_bench -- [--out launcher/bench/results.md]

1. Submit-to-RUNNING on an idle pool: SubmitJob, then WatchJob until RUNNING (one job at a
   time; the "trainer" is a Python process that sleeps, so process start is included).
2. ListJobs with 10,000 jobs stored while 100 submissions/s arrive (goal: p99 <= 50 ms):
   newest-100 pages, state-filtered and team-filtered pages, from 4 client threads; on each
   store (--stores): SQLite and PostgreSQL (a durable PostgreSQL 15 started here on
   127.0.0.1, launcher/testdata/postgres.py), two launchers taking the load in turns of 2 s.
3. One scheduling pass over 10,000 pending jobs (goal: <= 50 ms): the pure `scheduler.plan`
   beside `scheduler.plan_job_by_job` (the same rules applied to every job, which `plan`
   must equal), and the launcher's whole pass (`Controller._schedule`: holdings, plan,
   waiting reasons).
Results are medians and 99th percentiles of the samples taken here, printed as Markdown.
"""

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import threading
import time

from launcher import scheduler, settings
from launcher.bench.machine import machine
from launcher.client import Client
from launcher.controller import Controller
from launcher.events import JobEvents
from launcher.metrics import LauncherMetrics
from launcher.pg_store import PostgresStore
from launcher.server import Launcher
from launcher.store import JobStore
from launcher.testdata.postgres import running_postgres
from protos import job_pb2, launcher_pb2
from protos.files import write_atomic
from protos.paths import user_path

SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]  # ignores the trainer flags
TEAMS = ["nlp", "vision", "speech", "infra"]
SUBMITTERS = 4  # client threads sharing the submission rate
LISTERS = 4  # people and dashboards listing jobs ...
LIST_RATE = 40.0  # ... this many ListJobs a second in all
SLICE_SECONDS = 2.0  # with both stores, each takes the load this long in turn
DSN_ENV = "KITCHEN_BENCH_PG_DSN"  # how the benchmark's launcher finds its PostgreSQL
STORE_NAMES = {"sqlite": "SQLite", "postgres": "PostgreSQL"}


def pct(samples, q):
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ms(seconds):
    return f"{1000 * seconds:.1f} ms"


def spec(name, team="nlp", priority=0):
    s = job_pb2.JobSpec(name=name, kind=job_pb2.PRETRAIN, team=team, priority=priority)
    return s


def config(state_dir, nodes=1, postgres=False):
    cfg = launcher_pb2.LauncherConfig(
        listen="127.0.0.1:0", metrics_listen="none", state_dir=state_dir, trainer_cmd=SLEEPER,
        kill_grace_seconds=5,
    )  # fmt: skip
    cfg.pools.add(name="cpu", nodes=nodes)
    if postgres:
        cfg.store.postgres.dsn_env = DSN_ENV
    return cfg


def submit_to_running(tmp, n):
    launcher = Launcher(config(os.path.join(tmp, "idle"))).start()
    client = Client(launcher.address)
    latencies, server_side = [], []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            job = client.submit(spec(f"idle-{i}"))
            for update in client.watch(job.id):
                if update.state == job_pb2.RUNNING:
                    latencies.append(time.perf_counter() - t0)
                    started = update.started.ToNanoseconds() - update.created.ToNanoseconds()
                    server_side.append(started / 1e9)
                    break
            client.cancel(job.id)
            for _ in client.watch(job.id):
                pass  # until it ends: the pool is idle again
    finally:
        client.close()
        launcher.stop()
    return latencies, server_side


def fill_store(path, n, state, team_of=lambda i: TEAMS[i % len(TEAMS)], pool="cpu", dsn=""):
    """`n` jobs into the SQLite database at `path`, or into PostgreSQL at `dsn` (its state dir
    is `path`'s directory); each job's run dir is made, as for a real one."""
    state_dir = os.path.dirname(path)
    store = PostgresStore(dsn, state_dir, durable=False) if dsn else JobStore(path, durable=False)
    for i in range(n):
        job = job_pb2.Job(spec=spec(f"old-{i}", team_of(i), priority=i % 3), state=state, pool=pool)
        store.insert(job)
    store.close()


class BusyLauncher:
    """One store's launcher for part 2: `stored` finished jobs, its pool held by a blocker so
    arrivals queue up; `drive()` sends it submissions and lists for a while. With both stores,
    the two launchers take turns (SLICE_SECONDS each), so that each sees the same machine."""

    def __init__(self, tmp, stored, dsn=""):
        state_dir = os.path.join(tmp, "busy-postgres" if dsn else "busy")
        os.makedirs(state_dir)
        t0 = time.perf_counter()
        fill_store(os.path.join(state_dir, "jobs.sqlite"), stored, job_pb2.SUCCEEDED, dsn=dsn)
        self.fill_seconds = time.perf_counter() - t0
        os.environ[DSN_ENV] = dsn  # read once, when the launcher opens its store
        self.launcher = Launcher(config(state_dir, postgres=bool(dsn))).start()
        self.client = Client(self.launcher.address)
        self.blocker = self.client.submit(spec("blocker", priority=100))
        self.submit_times: list[float] = []
        self.list_times: dict[str, list[float]] = {
            "newest 100": [], "state=QUEUED": [], "team=vision": []
        }  # fmt: skip
        self.seconds = 0.0

    def drive(self, rate, seconds):
        stop = threading.Event()
        address = self.launcher.address

        def paced(per_second, call):
            """Calls `call(i)` per_second times a second on its own schedule until stopped."""
            next_at, i = time.perf_counter(), 0
            while not stop.is_set():
                call(i)
                i += 1
                next_at += 1.0 / per_second
                time.sleep(max(0.0, next_at - time.perf_counter()))

        def submitter(k):
            own = Client(address)

            def one(i):
                t = time.perf_counter()
                own.submit(spec(f"new-{k}-{i}", TEAMS[i % len(TEAMS)]))
                self.submit_times.append(time.perf_counter() - t)

            paced(rate / SUBMITTERS, one)
            own.close()

        def lister(k):
            own = Client(address)
            kinds = [
                ("newest 100", {}),
                ("state=QUEUED", {"states": [job_pb2.QUEUED]}),
                ("team=vision", {"team": "vision"}),
            ]

            def one(i):
                name, filters = kinds[(i + k) % len(kinds)]
                t = time.perf_counter()
                own.list(page_size=100, **filters)
                self.list_times[name].append(time.perf_counter() - t)

            paced(LIST_RATE / LISTERS, one)
            own.close()

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(SUBMITTERS)]
        threads += [threading.Thread(target=lister, args=(k,)) for k in range(LISTERS)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        self.seconds += seconds

    def finish(self):
        """(fill s, submit times, list times by kind, arrivals/s, (passes, their total s))."""
        passes = self.launcher.metrics.scheduler_pass.collect()[0].samples
        count = next(s.value for s in passes if s.name.endswith("_count"))
        total = next(s.value for s in passes if s.name.endswith("_sum"))
        self.client.cancel(self.blocker.id)
        self.client.close()
        self.launcher.stop()
        arrived = len(self.submit_times) / self.seconds
        return self.fill_seconds, self.submit_times, self.list_times, arrived, (count, total)


def timed(repeats, call):
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return samples


def alternating(repeats, calls: dict) -> dict:
    """{name: durations} of calls made in turn, so that each sees the same machine load."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name] += timed(1, call)
    return samples


def scheduler_passes(tmp, pending, repeats):
    """{scenario: pass durations} for `pending` queued jobs over three pools and four teams."""
    pools = {
        "cpu": scheduler.Pool("cpu", 16, 0),
        "a100": scheduler.Pool("a100", 32, 8),
        "h100": scheduler.Pool("h100", 64, 8),
    }
    quotas = {"nlp": scheduler.Quota(0, 64), "vision": scheduler.Quota(8, 0)}
    names = list(pools)
    demands = [
        scheduler.Demand(
            f"j{i}", i, i % 5, names[i % 3], TEAMS[i % 4], 1 + i % 4, (0, 1, 2, 8)[i % 4]
        )
        for i in range(pending)
    ]
    # Pools held by higher-priority jobs: nothing starts, nothing is preempted.
    full = [
        scheduler.Holding(f"r-{p}-{n}", 99, p, "infra", ((n, tuple(range(8))),), 0.0)
        for p in names
        for n in range(pools[p].nodes)
    ]
    out, ratios = {}, {}
    admitted = len(scheduler.plan(pools, quotas, demands, [], now=1.0).start)
    for holdings, case in (
        (full, "pools full (all wait)"),
        ([], f"pools empty ({admitted} admitted, the rest wait)"),
    ):
        calls = {
            f"scheduler.{plan.__name__}, {case}": functools.partial(
                plan, pools, quotas, demands, holdings, now=1.0
            )
            for plan in (scheduler.plan, scheduler.plan_job_by_job)
        }
        samples = alternating(repeats, calls)
        fast, reference = samples.values()
        ratios[case.split(" (")[0]] = pct(reference, 50) / pct(fast, 50)
        out.update(samples)

    state_dir = os.path.join(tmp, "pending")
    os.makedirs(state_dir)
    path = os.path.join(state_dir, "jobs.sqlite")
    fill_store(path, pending, job_pb2.QUEUED)
    store = JobStore(path)
    holder, _ = store.insert(job_pb2.Job(spec=spec("holder", "infra", 99), pool="cpu"))
    holder.state, holder.handle = job_pb2.RUNNING, '{"attempt_dir": "/none", "launched_at": 0}'
    holder.allocation.add(node=0)
    store.update(holder)
    controller = Controller(
        settings.resolve(config(state_dir)), store, {}, LauncherMetrics(60), JobEvents()
    )
    controller.recover()

    # The first pass after a start finds every waiting reason new and publishes it to
    # watchers; later passes find them unchanged. Forgetting the reasons repeats the first.
    def first_pass():
        controller.jobs.set_waiting({})
        controller._schedule(time.time())

    out[f"the launcher's whole pass, first after start ({pending:,} reasons published)"] = timed(
        5, first_pass
    )
    out["the launcher's whole pass, steady state (pool full)"] = timed(
        repeats, lambda: controller._schedule(time.time())
    )
    store.close()
    return out, ratios


def command(p: argparse.ArgumentParser, args) -> str:
    """The command line that ran, without --out, and "(defaults)" only when it was that."""
    flags = [
        f"--{name.replace('_', '-')} {f'{value:g}' if isinstance(value, float) else value}"
        for name, value in vars(args).items()
        if name != "out" and value != p.get_default(name)
    ]
    if not flags:
        return "`bazel run //launcher/bench:launcher_bench` (defaults)"
    return f"`bazel run //launcher/bench:launcher_bench -- {' '.join(flags)}`"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="also write the Markdown here")
    p.add_argument("--idle-jobs", type=int, default=30)
    p.add_argument("--stored", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=100.0, help="submissions per second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--pending", type=int, default=10_000)
    p.add_argument("--stores", default="sqlite,postgres", help="ListJobs under load on each")
    args = p.parse_args()
    stores = args.stores.split(",")
    if not stores or not set(stores) <= set(STORE_NAMES):
        p.error(f"--stores: a comma-separated list of {', '.join(STORE_NAMES)}")
    load_before = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="kitchen-bench-") as tmp:
        print(f"1/3 submit-to-RUNNING, {args.idle_jobs} jobs one at a time ...", flush=True)
        idle, idle_server = submit_to_running(tmp, args.idle_jobs)
        print(
            f"2/3 ListJobs on {' and '.join(STORE_NAMES[n] for n in stores)} with "
            f"{args.stored:,} stored, {args.rate:.0f} submits/s ...",
            flush=True,
        )
        with contextlib.ExitStack() as stack:
            busy = {}
            for name in stores:
                dsn = ""
                if name == "postgres":
                    server = stack.enter_context(running_postgres(durable=True))
                    dsn = server.create_database("bench")
                busy[name] = BusyLauncher(tmp, args.stored, dsn)
            for _ in range(max(1, round(args.seconds / SLICE_SECONDS))):
                for launcher in busy.values():
                    launcher.drive(args.rate, SLICE_SECONDS)
            under_load = {name: launcher.finish() for name, launcher in busy.items()}
        print(f"3/3 scheduling passes over {args.pending:,} pending jobs ...", flush=True)
        passes_by_kind, ratios = scheduler_passes(tmp, args.pending, repeats=50)

    rows = [
        ("Submit-to-RUNNING, idle pool (client: SubmitJob until WatchJob says RUNNING)",
         len(idle), ms(pct(idle, 50)), ms(pct(idle, 99)), ""),
        ("  same, inside the launcher (Job.started - Job.created)",
         len(idle_server), ms(pct(idle_server, 50)), ms(pct(idle_server, 99)), ""),
    ]  # fmt: skip
    notes, all_lists = [], {}
    for name, (fill, submits, lists, arrived, (passes, pass_sum)) in under_load.items():
        store = STORE_NAMES[name]
        all_lists[name] = samples = [t for v in lists.values() for t in v]
        rows.append(
            (f"ListJobs on {store}, all kinds, {args.stored:,} stored + {arrived:.0f} "
             "submits/s arriving", len(samples), ms(pct(samples, 50)), ms(pct(samples, 99)),
             "p99 <= 50 ms")
        )  # fmt: skip
        for kind, samples in lists.items():
            rows.append((f"  ListJobs {kind} (page of 100)", len(samples),
                         ms(pct(samples, 50)), ms(pct(samples, 99)), ""))  # fmt: skip
        durable = "fsync per job" if name == "sqlite" else "synchronous commit per job"
        rows.append((f"SubmitJob on {store} during that load (durable: {durable})",
                     len(submits), ms(pct(submits, 50)), ms(pct(submits, 99)), ""))  # fmt: skip
        notes.append(
            f"{store}: prefill of {args.stored:,} jobs took {fill:.1f} s (no fsync; one run dir "
            f"each); its launcher ran {passes:.0f} scheduling passes in part 2, "
            f"{ms(pass_sum / max(passes, 1))} each on average (its own "
            "`kitchen_scheduler_pass_duration_seconds`)."
        )
    for name, samples in passes_by_kind.items():
        what = f"Scheduling pass over {args.pending:,} pending: {name}"
        rows.append((what, len(samples), ms(pct(samples, 50)), ms(pct(samples, 99)), "<= 50 ms"))
    side_by_side = [
        "Side by side (calls alternating), p50 of `plan_job_by_job` / p50 of `plan`: "
        + "; ".join(f"{case} {ratio:.1f}x" for case, ratio in ratios.items())
        + "."
    ]
    if len(all_lists) == 2:
        pg, lite = all_lists["postgres"], all_lists["sqlite"]
        side_by_side.append(
            f"ListJobs under the same load, PostgreSQL / SQLite (taking turns every "
            f"{SLICE_SECONDS:g} s): "
            f"p50 {pct(pg, 50) / pct(lite, 50):.1f}x, p99 {pct(pg, 99) / pct(lite, 99):.1f}x."
        )
    lines = [
        "# Launcher benchmark",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M %Z')} on {machine()}.",
        f"Load average when it began {load_before} (other sessions share these CPUs).",
        f"Command: {command(p, args)}. " + " ".join(notes),
        "",
        "| what | samples | p50 | p99 | goal |",
        "| --- | ---: | ---: | ---: | --- |",
        *[f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows],
        "",
        *side_by_side,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_atomic(user_path(args.out), text + "\n")


if __name__ == "__main__":
    main()
