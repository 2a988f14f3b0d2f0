"""The chaos soak's sample of real training jobs (launcher/bench/chaos_soak.py): a few tiny
pretrain jobs run by the real trainer (as a process: the launcher never imports it), each
trainer killed with -9 once mid-run (after its first checkpoint), the launcher replicas and the
database under the soak's faults meanwhile; their final weights compared bitwise with an
uninterrupted run of the same spec, run first on the same launchers (one attempt, before any
fault). Weights are compared as the bytes of the final checkpoint's model.pt (SHA-256): no
torch here. Compare only on one machine (CPU kernels round differently across machines)."""

import contextlib
import dataclasses
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from launcher.client import Client
from launcher.executors.attempt_wrapper import start_ticks
from launcher.executors.base import read_json
from launcher.testdata import harness as h
from launcher.transitions import parse_handle
from protos import job_pb2
from protos.config_yaml import job_spec_from_dict
from protos.paths import step_dirs

NAME, REFERENCE = "soak-real", "soak-real-reference"
CHECKPOINT_EVERY = 10


def spec(name: str, steps: int, cache_dir: Path) -> job_pb2.JobSpec:
    """A tiny pretrain job (the trainer tests' size: trainer/testing.py tiny_job): a 2-layer
    model on 64-token rows of the standard library's email package, fp32 on CPU."""
    email = os.path.join(os.path.dirname(os.__file__), "email")
    trainer = {
        "data": {"input": email, "vocab_size": 512, "seq_len": 64, "eval_fraction": 0.1,
                 "cache_dir": str(cache_dir), "workers": 1},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": steps, "micro_batch": 4, "log_every": 1, "eval_every": 0},
        "checkpoint": {"every_steps": CHECKPOINT_EVERY},
    }  # fmt: skip
    out = job_spec_from_dict({"name": name, "kind": "PRETRAIN", "trainer": trainer})
    out.retry.max_attempts = 20  # the soak's faults cost attempts
    out.retry.backoff_seconds = 0.5
    return out


def final_weights(job: job_pb2.Job) -> tuple[str, str]:
    """(checkpoint directory name, SHA-256 of its model.pt) of the job's newest checkpoint."""
    newest = step_dirs(os.path.join(job.run_dir, "checkpoints"))
    if not newest:
        return "", ""
    with open(os.path.join(newest[-1], "model.pt"), "rb") as f:
        return os.path.basename(newest[-1]), hashlib.sha256(f.read()).hexdigest()


@dataclasses.dataclass
class Sample:
    """`n` real jobs on the launchers at `addresses`; `behaviour_dir` is the fake trainer's."""

    addresses: str
    tmp: Path
    n: int
    steps: int
    reference: job_pb2.Job | None = None
    ids: list[str] = dataclasses.field(default_factory=list)
    killed: set[str] = dataclasses.field(default_factory=set)  # jobs whose trainer was killed

    def __post_init__(self):
        for name in (NAME, REFERENCE):  # the fake trainer becomes the real one for these
            h.behave(self.tmp, name, exec=[sys.executable, "-m", "trainer.main"])
        self.done = threading.Event()
        self.killer = threading.Thread(target=self._kill_each_once, daemon=True)

    def run_reference(self, timeout: float = 900.0) -> None:
        """The uninterrupted run (it also precooks the data the sample then reads)."""
        with contextlib.closing(Client(self.addresses)) as client:
            job = client.submit(spec(REFERENCE, self.steps, self.tmp / "cache"))
            self.reference = h.wait_for(client, job.id, h.FINAL, timeout=timeout)
        if (self.reference.state, self.reference.attempts) != (job_pb2.SUCCEEDED, 1):
            raise RuntimeError(f"the reference run did not succeed at once: {self.reference}")

    def submit(self) -> None:
        with contextlib.closing(Client(self.addresses)) as client:
            for _ in range(self.n):
                self.ids.append(client.submit(spec(NAME, self.steps, self.tmp / "cache")).id)
        self.killer.start()

    def _kill_each_once(self) -> None:
        """kill -9 of each job's trainer once, after its first checkpoint, before its end."""
        with contextlib.closing(Client(self.addresses)) as client:
            while not self.done.is_set() and len(self.killed) < len(self.ids):
                for job_id in self.ids:
                    try:
                        if job_id not in self.killed and self._kill(client.get(job_id)):
                            self.killed.add(job_id)
                    except Exception:  # replicas or the database down meanwhile: next round
                        pass
                time.sleep(0.2)

    def _kill(self, job: job_pb2.Job) -> bool:
        if job.state != job_pb2.RUNNING or not step_dirs(os.path.join(job.run_dir, "checkpoints")):
            return False
        pids = read_json(os.path.join(parse_handle(job)["attempt_dir"], "pid.json"))
        if pids is None or start_ticks(pids["child_pgid"]) != pids["child_start_ticks"]:
            return False
        os.kill(pids["child_pgid"], signal.SIGKILL)
        return True

    def report(self, jobs: dict[str, job_pb2.Job]) -> tuple[list[str], list[str], list[str]]:
        """Markdown lines; the sample jobs whose final weights equal the reference's, and those
        that do not (or did not finish)."""
        self.done.set()
        assert self.reference is not None
        want = final_weights(self.reference)
        equal: list[str] = []
        differ: list[str] = []
        rows: list[str] = []
        for job_id in self.ids:
            job = jobs[job_id]
            got = final_weights(job)
            same = job.state == job_pb2.SUCCEEDED and got == want and bool(want[1])
            (equal if same else differ).append(job_id)
            rows.append(
                f"{job_id} {job_pb2.JobState.Name(job.state)}, {job.attempts} attempts, trainer "
                f"{'killed' if job_id in self.killed else 'not killed'}, {got[0]} "
                f"{got[1][:12]} ({'equal' if same else 'DIFFERENT'})"
            )
        lines = [
            f"- **real jobs, final weights bitwise equal to an uninterrupted run: {len(equal)} of "
            f"{len(self.ids)}** (tiny pretrain, {self.steps} steps, a checkpoint every "
            f"{CHECKPOINT_EVERY}; each trainer killed -9 once mid-run: {len(self.killed)}; the "
            f"reference {self.reference.id}: {want[0]} model.pt {want[1][:12]}): " + "; ".join(rows)
        ]
        return lines, equal, differ
