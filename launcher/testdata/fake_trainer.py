"""A stand-in trainer for the launcher's tests: speaks the trainer contract without torch.

    fake_trainer.py [--behaviour-dir DIR] --attempt ATTEMPT.json

ATTEMPT.json is the launcher's handoff (a kitchen.v1.Attempt, see launcher/executors/handoff.py):
job id, attempt number, spec, run dir, the launcher's address, the token file and the TLS root.
Like the real trainer it resumes from its newest checkpoint, writes metrics.jsonl, streams
kitchen.v1.Progress to the launcher (best effort, with the token read from token_file and
tls_ca when set), and on SIGTERM saves a checkpoint and exits 75.
What it does wrong on purpose comes from `<behaviour-dir>/<job name>.json`:
  {"steps": 20, "step_seconds": 0.05, "checkpoint_every": 2,
   "crash_at": 3, "crash_attempts": [1],          exit 1 at step 3 on attempt 1
   "hang_at": 2, "hang_attempts": [1], "ignore_term": true,   stop reporting at step 2
   "exit_code": 2,                                 exit with this code at once
   "exec": ["python3", "-m", "trainer.main"]}      become this command (the real trainer:
                                                   the chaos soak's sample of real jobs)
Every step it runs is appended to `<run_dir>/steps.log` as "attempt step", so a test can see
that no step ran twice at once and that a retry resumed from the checkpoint.
"""

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time

import grpc
from google.protobuf import json_format

from protos import attempt_pb2, launcher_addresses, launcher_pb2_grpc, progress_pb2
from protos.exit_codes import ExitCode
from protos.files import write_atomic

stop_requested = threading.Event()


STALE_POLL_SECONDS = 0.2  # under the reconnect pause (0.5 s): a dead stream lets go first


def _reporter(attempt, attempt_queue):
    """Streams progress to the launcher; reconnects on errors; never raises. As
    trainer/progress_client.py does: the address is an index into the replica list, moved on at
    each failed stream, and a stream stops taking from the queue once it is over (gRPC's thread
    may still wait on it: a report it took then would be lost, not sent on the next stream);
    the report in flight when a stream broke goes first on the next one."""
    metadata = None
    if attempt.token_file:
        with open(attempt.token_file) as f:
            metadata = [("authorization", f"Bearer {f.read().strip()}")]
    addresses = launcher_addresses.split(attempt.launcher)  # replicas: each in turn
    current = 0  # the address streamed to now
    pending: list = []  # the report taken but maybe not delivered

    def messages(alive: threading.Event):
        if pending:
            yield pending[0]
        while alive.is_set():
            try:
                item = attempt_queue.get(timeout=STALE_POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                return
            pending[:] = [item]
            yield item
            pending.clear()

    while True:
        address = addresses[current]
        if attempt.tls_ca:
            with open(attempt.tls_ca, "rb") as ca:
                credentials = grpc.ssl_channel_credentials(ca.read())
            channel = grpc.secure_channel(address, credentials)
        else:
            channel = grpc.insecure_channel(address)
        alive = threading.Event()
        alive.set()
        try:
            stub = launcher_pb2_grpc.LauncherStub(channel)
            try:
                response = stub.ReportProgress(messages(alive), metadata=metadata)
            finally:
                alive.clear()  # before the pause: the next stream starts clean
            if response.stop:
                stop_requested.set()
            return
        except grpc.RpcError as e:
            print(f"fake_trainer: progress stream to {address} failed: {e.code()}",
                  file=sys.stderr, flush=True)  # fmt: skip
            current = (current + 1) % len(addresses)  # the next replica: it may lead now
            time.sleep(0.5)
        finally:
            channel.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--behaviour-dir")
    p.add_argument("--attempt", required=True, help="the launcher's handoff (attempt.json)")
    args = p.parse_args()
    with open(args.attempt) as f:
        attempt = json_format.Parse(f.read(), attempt_pb2.Attempt())
    spec, number, run_dir = attempt.spec, attempt.number, attempt.run_dir
    behaviour = {}
    if args.behaviour_dir:
        path = os.path.join(args.behaviour_dir, f"{spec.name}.json")
        if os.path.exists(path):
            with open(path) as f:
                behaviour = json.load(f)
    if "exec" in behaviour:  # the same process (pid) becomes it, with the same handoff
        command = [*behaviour["exec"], "--attempt", args.attempt]
        os.execv(command[0], command)
    if "exit_code" in behaviour:
        print(f"fake_trainer: exiting with {behaviour['exit_code']} as told", flush=True)
        return behaviour["exit_code"]

    ignore_term = behaviour.get("ignore_term") and number in behaviour.get("hang_attempts", [])
    signal.signal(
        signal.SIGTERM, signal.SIG_IGN if ignore_term else (lambda *_: stop_requested.set())
    )
    steps = spec.trainer.train.steps if spec.trainer.train.HasField("steps") else 20
    steps = behaviour.get("steps", steps)
    every = behaviour.get("checkpoint_every", 2)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    done = [
        int(n[5:-5]) for n in os.listdir(ckpt_dir) if n.startswith("step-") and n.endswith(".json")
    ]
    step = max(done, default=0)
    reports: queue.Queue[progress_pb2.Progress | None] = queue.Queue()  # None ends the stream
    reporter = threading.Thread(target=_reporter, args=(attempt, reports), daemon=True)
    if attempt.launcher:
        reporter.start()
    print(f"fake_trainer: attempt {number} starts at step {step} of {steps}", flush=True)

    def checkpoint():
        write_atomic(os.path.join(ckpt_dir, f"step-{step}.json"), json.dumps({"step": step}))

    while step < steps:
        if stop_requested.is_set():
            checkpoint()
            print(f"fake_trainer: SIGTERM: checkpoint at step {step}, exit 75", flush=True)
            reports.put(None)
            if attempt.launcher:
                reporter.join(timeout=5)
            return ExitCode.PREEMPTED
        step += 1
        if step == behaviour.get("crash_at") and number in behaviour.get("crash_attempts", [1]):
            print(f"fake_trainer: RuntimeError: crash at step {step} as told", flush=True)
            return 1
        if step == behaviour.get("hang_at") and number in behaviour.get("hang_attempts", [1]):
            print(f"fake_trainer: hanging at step {step} as told", flush=True)
            while True:
                time.sleep(3600)
        time.sleep(behaviour.get("step_seconds", 0.05))
        with open(os.path.join(run_dir, "steps.log"), "a") as f:
            f.write(f"{number} {step}\n")
        progress = progress_pb2.Progress(
            job_id=attempt.job_id, attempt=number, phase="train", step=step, total_steps=steps,
            loss=10.0 / step, tokens_per_second=1000.0, step_time_seconds=0.05, mfu=0.25,
            mfu_basis="measured", tokens_total=step * 64, goodput=0.9, lr=1e-3,
        )  # fmt: skip
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(
                json_format.MessageToJson(progress, preserving_proto_field_name=True, indent=None)
            )
            f.write("\n")
        reports.put(progress)
        if step % every == 0:
            checkpoint()
    # Like the real trainer: a last report with only a summary (zeros elsewhere).
    summary = progress_pb2.Progress(job_id=attempt.job_id, attempt=number, phase="done", step=step)
    summary.message = f"done at step {step}"
    reports.put(summary)
    reports.put(None)
    if attempt.launcher:
        reporter.join(timeout=5)  # let the last reports go out
    print(f"fake_trainer: done at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
