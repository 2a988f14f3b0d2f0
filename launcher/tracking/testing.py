"""A real `mlflow server` for tests: on 127.0.0.1, a sqlite store in a directory of the test's.

It takes ~20 s to come up on an idle 2-core machine, over 120 s at load 12: share one per
test file.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(directory: str, port: int) -> list[str]:
    """`mlflow server` over <directory>/mlflow.db, artifacts in <directory>/artifacts."""
    return [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{directory}/mlflow.db",
        "--default-artifact-root", os.path.join(directory, "artifacts"),
    ]  # fmt: skip


class MlflowServer:
    def __init__(self, directory: str, port: int = 0):
        self.dir = directory
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(directory, "server.log")

    def start(self, timeout: float = 300.0) -> "MlflowServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                server_command(self.dir, self.port), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its workers die with it (kill)
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        with open(self.log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise TimeoutError(f"mlflow server not up in {timeout} s; {self.log} ends:\n{tail}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: the whole process group (uvicorn's worker too)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def write_run(run_dir, job_id: str, spec, losses: list[float]) -> None:
    """A finished run directory as a launcher leaves it: attempts/001/attempt.json (the spec)
    and metrics.jsonl with one training record per step (1..len(losses)), one eval record and
    the closing "done" record, written by protos/progress_log.py as the trainer writes them."""
    from google.protobuf import json_format  # noqa: PLC0415

    from protos import attempt_file, attempt_pb2, progress_pb2  # noqa: PLC0415
    from protos.progress_log import append_progress, log_path  # noqa: PLC0415

    attempt_dir = attempt_file.attempt_dir(str(run_dir), 1)
    os.makedirs(attempt_dir, exist_ok=True)
    attempt = attempt_pb2.Attempt(job_id=job_id, number=1, spec=spec, run_dir=str(run_dir))
    with open(os.path.join(attempt_dir, attempt_file.ATTEMPT_FILE), "w") as f:
        f.write(json_format.MessageToJson(attempt))
    steps = len(losses)
    for step, loss in enumerate(losses, start=1):
        append_progress(log_path(run_dir), progress_pb2.Progress(
            job_id=job_id, attempt=1, phase="train", step=step, total_steps=steps, loss=loss,
            lr=3e-4, step_time_seconds=0.5, tokens_per_second=4000.0, mfu=0.01,
        ))  # fmt: skip
    for phase, eval_loss, goodput in (("eval", losses[-1] + 0.1, 0.0), ("done", 0.0, 0.9)):
        append_progress(log_path(run_dir), progress_pb2.Progress(
            job_id=job_id, attempt=1, phase=phase, step=steps, total_steps=steps,
            eval_loss=eval_loss, goodput=goodput,
        ))  # fmt: skip
