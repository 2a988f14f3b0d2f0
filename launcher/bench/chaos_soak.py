"""Chaos soak of replicated launchers: jobs keep being submitted while launcher replicas and
trainers are killed with -9 and the database restarts; then what became of every job.

    bazel run //launcher/bench:chaos_soak -- [--jobs 100] [--replicas 3] [--lease 2]
                                             [--real-jobs 2] [--real-steps 30]

Real parts: a PostgreSQL 15 (//launcher/testdata:postgres, durable), `--replicas` launcher
processes (python -m launcher.server) sharing it and one state dir, each job a fake trainer
(launcher/testdata/fake_trainer.py: steps, checkpoints, resumes; no torch) on a local pool.
Every few seconds one fault, at random: kill -9 of the leader, of a follower, or of a running
trainer; and `--db-restarts` database crashes (SIGQUIT: immediate shutdown, WAL recovery). A
killed replica comes back after 1-3 s, as under a supervisor; so does a former leader that
exits on finding its lease taken. Submissions go to all replicas (the client fails over).
Beside them, `--real-jobs` tiny pretrain jobs of the real trainer (launcher/bench/
chaos_real_jobs.py), each trainer killed -9 once mid-run, and one uninterrupted run of the same
spec before the faults begin.

Figures:
- jobs lost: an acknowledged submission the store does not have, or one never finished;
- jobs run twice at once: a job whose steps.log (one "attempt step" line per step run) shows
  an earlier attempt stepping after a later one began, or one attempt's step run twice;
- jobs in each terminal state; attempts (trainer kills cost one);
- failover time: from kill -9 of the leader to the next epoch in the lease row, p50 and p99;
- real jobs whose final weights are bitwise equal to the uninterrupted run's.
"""

import argparse
import dataclasses
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg

from launcher.bench.chaos_real_jobs import Sample
from launcher.bench.machine import machine
from launcher.client import Client
from launcher.server import LOST_LEASE_EXIT
from launcher.testdata import harness as h
from launcher.testdata.postgres import running_postgres
from protos import job_pb2, launcher_pb2


@dataclasses.dataclass(frozen=True)
class Outcome:
    lost: list[str]  # acknowledged, and missing or never finished
    twice: list[str]  # run twice at once
    terminal: int  # jobs in a final state
    stored: int  # jobs in the store
    failovers: list[float]  # seconds
    weights_equal: list[str]  # real jobs whose final weights equal the uninterrupted run's
    weights_differ: list[str]  # real jobs whose do not, or that did not finish


@dataclasses.dataclass
class Counts:
    leader_kills: int = 0
    follower_kills: int = 0
    trainer_kills: int = 0
    db_restarts: int = 0
    lost_lease_exits: int = 0
    failovers: list = dataclasses.field(default_factory=list)  # seconds


def leader(dsn: str) -> tuple[int, str]:
    with psycopg.connect(dsn, connect_timeout=5) as db:
        row = db.execute("SELECT epoch, address FROM leader").fetchone()
    assert row is not None
    return row[0], row[1]


def trainers(behaviour_dir: str) -> list[int]:
    """The pids of running fake trainers of this soak."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if h.FAKE_TRAINER.encode() in argv and behaviour_dir.encode() in argv:
                found.append(int(entry))
    return found


def twice_at_once(steps_log: Path) -> bool:
    """An earlier attempt stepping after a later one began, or one attempt's step run twice."""
    try:
        lines = steps_log.read_text().split()
    except FileNotFoundError:
        return False
    pairs = list(zip(map(int, lines[0::2]), map(int, lines[1::2]), strict=True))
    newest, seen = 0, set()
    for attempt, step in pairs:
        if attempt < newest or (attempt, step) in seen:
            return True
        newest = max(newest, attempt)
        seen.add((attempt, step))
    return False


class Soak:
    def __init__(self, args, pg, tmp: Path):
        self.args, self.pg, self.tmp = args, pg, tmp
        self.dsn = pg.create_database("soak")
        store = launcher_pb2.StoreConfig(
            postgres=launcher_pb2.PostgresStore(
                dsn_env="KITCHEN_PG_DSN", replicas=True, lease_seconds=args.lease
            )
        )
        cfg = h.config(tmp, nodes=args.nodes, store=store)
        cfg.metrics_listen = "none"
        cfg.poll_interval_seconds = 0.2
        h.behave(tmp, "soak", steps=args.steps, step_seconds=args.step_seconds)
        env = {"KITCHEN_PG_DSN": self.dsn}
        self.replicas = [
            h.LauncherProcess(tmp, cfg, env=env, name=f"r{i}") for i in range(args.replicas)
        ]
        self.addresses = ",".join(r.address for r in self.replicas)
        self.counts = Counts()
        self.submitted: dict[str, str] = {}  # request_id -> job id
        self.rng = random.Random(args.seed)
        self.done = threading.Event()
        self.sample = (
            Sample(self.addresses, tmp, args.real_jobs, args.real_steps) if args.real_jobs else None
        )

    def start(self):
        for r in self.replicas:
            r.start().close()

    def revive(self):
        """Restarts replicas that died (killed, or exited on a lost lease), as a supervisor."""
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is not None:
                if r.proc.returncode == LOST_LEASE_EXIT:
                    self.counts.lost_lease_exits += 1
                try:
                    r.start().close()
                except Exception as e:  # the database restarting: tried again next round
                    print(f"  restart of {r.address} failed: {e!r}", file=sys.stderr)
                    if r.proc is not None and r.proc.poll() is None:
                        r.kill9()

    def submit_all(self):
        client = Client(self.addresses)
        spec = h.spec("soak", steps=self.args.steps)
        spec.retry.max_attempts = 20  # trainer kills cost attempts
        for _ in range(self.args.jobs):
            request_id = uuid.uuid4().hex
            while not self.done.is_set():
                try:
                    self.submitted[request_id] = client.submit(spec, request_id=request_id).id
                    break
                except Exception:  # every replica down or the database restarting: retry
                    time.sleep(0.5)  # the same request_id: never a second job
            time.sleep(self.args.submit_interval)
        client.close()

    def fault(self, kind: str):
        if kind == "leader":
            epoch, address = leader(self.dsn)
            target = next((r for r in self.replicas if r.address == address), None)
            if target is None or target.proc is None or target.proc.poll() is not None:
                return
            killed = time.monotonic()
            target.kill9()
            self.counts.leader_kills += 1
            deadline = killed + 120
            while time.monotonic() < deadline:
                try:
                    if leader(self.dsn)[0] > epoch:
                        self.counts.failovers.append(time.monotonic() - killed)
                        return
                except psycopg.Error:
                    pass
                time.sleep(0.05)
        elif kind == "follower":
            _, address = leader(self.dsn)
            alive = [r for r in self.replicas if r.address != address and r.proc is not None]
            if alive:
                self.rng.choice(alive).kill9()
                self.counts.follower_kills += 1
        elif kind == "trainer":
            pids = trainers(str(self.tmp / "behaviour"))
            if pids:
                try:
                    os.kill(self.rng.choice(pids), signal.SIGKILL)
                    self.counts.trainer_kills += 1
                except ProcessLookupError:
                    pass
        elif kind == "database":
            self.pg.restart(crash=True)
            self.counts.db_restarts += 1

    def unfinished(self) -> int:
        with psycopg.connect(self.dsn) as db:
            row = db.execute(
                "SELECT count(*) FROM jobs WHERE state NOT IN (%s, %s, %s)",
                [int(s) for s in h.FINAL],
            ).fetchone()
        assert row is not None
        return row[0]

    def run(self) -> dict:
        started = time.monotonic()
        submitter = threading.Thread(target=self.submit_all, daemon=True)
        submitter.start()
        if self.sample is not None:
            self.sample.submit()
        db_restart_at = sorted(
            self.rng.uniform(0.2, 0.8) * self.args.chaos_seconds
            for _ in range(self.args.db_restarts)
        )
        kinds = ["leader"] * 4 + ["follower"] * 2 + ["trainer"] * 4
        while time.monotonic() - started < self.args.chaos_seconds:
            time.sleep(self.rng.uniform(*self.args.fault_every))
            self.revive()
            if db_restart_at and time.monotonic() - started >= db_restart_at[0]:
                db_restart_at.pop(0)
                kind = "database"
            else:
                kind = self.rng.choice(kinds)
            try:
                self.fault(kind)
            except psycopg.Error as e:  # the lease row unreadable (database restarting)
                print(f"  fault {kind} skipped: {e}", file=sys.stderr)
        chaos = time.monotonic() - started
        deadline = time.monotonic() + self.args.drain_seconds
        while time.monotonic() < deadline:  # no more faults: every job should finish
            self.revive()
            if not submitter.is_alive() and self.unfinished() == 0:
                break
            time.sleep(1)
        self.done.set()
        return {"chaos_seconds": chaos, "total_seconds": time.monotonic() - started}

    def report(self, timing: dict) -> tuple[str, Outcome]:
        with psycopg.connect(self.dsn) as db:
            rows = db.execute("SELECT seq, state, job FROM jobs").fetchall()
        jobs = {f"j{seq}": job_pb2.Job.FromString(blob) for seq, _, blob in rows}
        acknowledged = set(self.submitted.values())
        lost = sorted(j for j in acknowledged if j not in jobs or jobs[j].state not in h.FINAL)
        twice = sorted(
            j for j, job in jobs.items() if twice_at_once(Path(job.run_dir) / "steps.log")
        )
        states: dict[str, int] = {}
        for job in jobs.values():
            name = job_pb2.JobState.Name(job.state)
            states[name] = states.get(name, 0) + 1
        terminal = sum(job.state in h.FINAL for job in jobs.values())
        attempts = [job.attempts for job in jobs.values()]
        f = sorted(self.counts.failovers)
        p = (lambda q: f[min(len(f) - 1, int(q * len(f)))]) if f else (lambda q: float("nan"))
        a = self.args
        lines = [
            f"- jobs submitted (acknowledged): {len(acknowledged)} of {a.jobs}; in the store: "
            f"{len(jobs)} (a retried submission reuses its request_id: no duplicates)",
            f"- **jobs lost: {len(lost)}**" + (f" ({', '.join(lost)})" if lost else ""),
            f"- **jobs run twice at once: {len(twice)}**"
            + (f" ({', '.join(twice)})" if twice else ""),
            f"- jobs in a terminal state: {terminal} of {len(jobs)}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(states.items())),
            f"- attempts per job: mean {statistics.mean(attempts):.2f}, max {max(attempts)}",
            f"- faults: {self.counts.leader_kills} leader kill -9, {self.counts.follower_kills} "
            f"follower kill -9, {self.counts.trainer_kills} trainer kill -9, "
            f"{self.counts.db_restarts} database crash-restart; former leaders that exited on "
            f"a lost lease: {self.counts.lost_lease_exits}",
            f"- **failover time** (kill -9 of the leader to the next epoch; lease {a.lease:g} s): "
            f"p50 {p(0.5):.2f} s, p99 {p(0.99):.2f} s, max {max(f) if f else float('nan'):.2f} s "
            f"over {len(f)} failovers",
            f"- duration: {timing['chaos_seconds']:.0f} s of faults, "
            f"{timing['total_seconds']:.0f} s in all",
        ]
        equal: list[str] = []
        differ: list[str] = []
        if self.sample is not None:
            real, equal, differ = self.sample.report(jobs)
            lines[-1:-1] = real
        return "\n".join(lines), Outcome(lost, twice, terminal, len(jobs), f, equal, differ)


def soak(argv: list[str]) -> tuple[str, Outcome]:
    """Runs the soak `argv` describes (main's flags); the report in Markdown, and its figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--lease", type=float, default=2.0, help="lease seconds")
    p.add_argument("--nodes", type=int, default=4, help="the local pool's nodes (jobs at once)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-seconds", type=float, default=0.2)
    p.add_argument("--submit-interval", type=float, default=1.0)
    p.add_argument("--chaos-seconds", type=float, default=120.0)
    p.add_argument("--fault-every", type=float, nargs=2, default=(3.0, 8.0))
    p.add_argument("--db-restarts", type=int, default=1)
    p.add_argument("--drain-seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--real-jobs", type=int, default=2, help="tiny real pretrain jobs (0: none)")
    p.add_argument("--real-steps", type=int, default=30)
    args = p.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with running_postgres(durable=True) as pg, tempfile.TemporaryDirectory() as tmp:
        run = Soak(args, pg, Path(tmp))
        try:
            run.start()
            if run.sample is not None:
                run.sample.run_reference()  # before any fault: the uninterrupted run
            body, outcome = run.report(run.run())
        finally:
            for r in run.replicas:
                r.stop()
        if outcome.lost or outcome.twice or outcome.weights_differ:  # what the replicas said
            for r in run.replicas:
                tail = r.log_path.read_text(errors="replace").splitlines()[-60:]
                print(f"--- {r.log_path.name} (last lines)", *tail, sep="\n", file=sys.stderr)
    text = (
        f"## Chaos soak, {started}\n\n{machine()}; "
        f"flags: {' '.join(argv) or '(defaults)'}\n\n{body}"
    )
    return text, outcome


def main() -> int:
    text, outcome = soak(sys.argv[1:])
    print(text)
    return 0 if not (outcome.lost or outcome.twice or outcome.weights_differ) else 1


if __name__ == "__main__":
    sys.exit(main())
