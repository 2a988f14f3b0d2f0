"""Progress streams to a real gRPC server on 127.0.0.1; the launcher's `stop` preempts the run;
a launcher that is down costs the run nothing."""

import socket
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from protos import attempt_pb2, launcher_pb2, launcher_pb2_grpc, progress_pb2
from protos.exit_codes import ExitCode
from trainer import main
from trainer.progress_client import ProgressClient
from trainer.testing import tiny_job, write_attempt

torch.set_num_threads(1)


class Launcher(launcher_pb2_grpc.LauncherServicer):
    """Collects Progress; answers stop=True after `stop_after` train records (0: never)."""

    def __init__(self, stop_after: int = 0):
        self.received: list[progress_pb2.Progress] = []
        self.stop_after = stop_after
        self.metadata: set[tuple[str, str]] = set()
        self.lock = threading.Lock()

    def ReportProgress(self, request_iterator, context):
        self.metadata.update(context.invocation_metadata())
        for progress in request_iterator:
            with self.lock:
                self.received.append(progress)
                trains = sum(p.phase == "train" for p in self.received)
            if self.stop_after and trains >= self.stop_after:
                return launcher_pb2.ReportProgressResponse(stop=True)
        return launcher_pb2.ReportProgressResponse(stop=False)


@pytest.fixture
def launcher():
    servers = []

    def start(stop_after=0, tls=None):
        servicer = Launcher(stop_after)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        launcher_pb2_grpc.add_LauncherServicer_to_server(servicer, server)
        if tls:
            credentials = grpc.ssl_server_credentials([(tls[0].read_bytes(), tls[1].read_bytes())])
            port = server.add_secure_port("127.0.0.1:0", credentials)
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def run(tmp_path, cache, address, steps, checkpoint=None, **attempt):
    job = tiny_job(cache, steps=steps, **({"checkpoint": checkpoint} if checkpoint else {}))
    path = write_attempt(
        tmp_path / "attempt.json", job, tmp_path / "run",
        job_id="job-7", number=2, launcher=address, **attempt,
    )  # fmt: skip
    return main.main(["--attempt", str(path)])


def test_progress_reaches_the_launcher_with_the_job_identity(tmp_path, cache, launcher):
    token = tmp_path / "token"
    token.write_text("attempt-secret\n")
    servicer, address = launcher()
    assert run(tmp_path, cache, address, steps=4, token_file=str(token)) == ExitCode.OK
    assert ("authorization", "Bearer attempt-secret") in servicer.metadata
    train = [p for p in servicer.received if p.phase == "train" and p.tokens_per_second]
    assert [p.step for p in train] == [1, 2, 3, 4]
    assert all(p.job_id == "job-7" and p.attempt == 2 and p.total_steps == 4 for p in train)
    assert servicer.received[-1].phase == "done"


def test_the_launchers_stop_checkpoints_and_exits_75(tmp_path, cache, launcher):
    servicer, address = launcher(stop_after=3)
    no_periodic = {"every_steps": 0}
    assert run(tmp_path, cache, address, 500, checkpoint=no_periodic) == ExitCode.PREEMPTED
    (saved,) = (tmp_path / "run" / "checkpoints").iterdir()  # the one written on stop
    assert 3 <= int(saved.name.split("_")[1]) < 500


def test_a_launcher_that_is_down_does_not_stop_training(tmp_path, cache):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    assert run(tmp_path, cache, address, steps=3) == ExitCode.OK
    assert "retrying" in (tmp_path / "run" / "train.log").read_text()


def test_progress_over_tls_when_the_launcher_serves_it(tmp_path, cache, launcher):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    servicer, address = launcher(tls=(key, cert))
    assert run(tmp_path, cache, address, steps=2, tls_ca=str(cert)) == ExitCode.OK
    assert [p.step for p in servicer.received if p.phase == "train"] == [1, 2]


class Follower(launcher_pb2_grpc.LauncherServicer):
    """A launcher replica that does not lead: refuses progress, as launcher/service.py does."""

    def __init__(self):
        self.refused = 0

    def ReportProgress(self, request_iterator, context):
        self.refused += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "ReportProgress: this replica is not the leader")


def test_a_stream_given_replicas_settles_on_the_one_that_leads(launcher):
    leader, leader_address = launcher()
    follower = Follower()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    launcher_pb2_grpc.add_LauncherServicer_to_server(follower, server)
    follower_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        attempt = attempt_pb2.Attempt(launcher=f"{follower_address},{leader_address}")
        client = ProgressClient(attempt, log=lambda line: None)
        client.send(progress_pb2.Progress(job_id="job-7", attempt=1, step=1))
        deadline = time.monotonic() + 30
        while not follower.refused and time.monotonic() < deadline:
            time.sleep(0.05)  # the follower refuses
        time.sleep(1.0)  # past the backoff: the stream is on the leader
        for step in (2, 3):
            client.send(progress_pb2.Progress(job_id="job-7", attempt=1, step=step))
        client.close(timeout=30)
    finally:
        server.stop(grace=None)
    assert follower.refused >= 1  # tried first, refused
    # Every record sent once the stream is on the leader arrives (the refused stream's reader
    # takes none of them: it got step 2 before it let go), in order; step 1 went out on the
    # refused stream and is lost unless it was still the one in hand (best effort).
    assert [p.step for p in leader.received] in ([2, 3], [1, 2, 3])
