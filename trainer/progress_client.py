"""Streams Progress to the launcher over `Launcher.ReportProgress`, best effort.

A background thread owns the stream. When the launcher is down, records wait in a small
queue (the oldest dropped first) and the thread reconnects with backoff: training never
waits on it and never dies of it. When the launcher answers `stop`, `stop_requested` is set
and the loop checkpoints and exits as if preempted.

What the stream needs comes in the attempt's handoff (kitchen.v1.Attempt): the launcher's
address (several with replicas: a failed stream moves to the next, and a replica that does not
lead refuses it, so the stream settles on the leader, the one that started this attempt or the
one that adopted it after a failover), the file holding this attempt's bearer token (when the
launcher has auth on; the token is read from the file, never from argv or the environment) and
the certificate to trust (when it serves TLS).
"""

import queue
import threading
import time

from protos import attempt_pb2, launcher_addresses

QUEUE_SIZE = 256
STALE_POLL_SECONDS = 0.2  # under the reconnect backoff (0.5 s): a dead stream lets go first
_CLOSE = object()


class ProgressClient:
    def __init__(self, attempt: attempt_pb2.Attempt, log=print):
        self.addresses = launcher_addresses.split(attempt.launcher)
        self._current = 0  # the address streamed to now
        self.tls_ca = attempt.tls_ca
        self.token = ""
        if attempt.token_file:
            with open(attempt.token_file, encoding="ascii") as f:
                self.token = f.read().strip()
        self.log = log
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.stop_requested = threading.Event()
        self.closed = threading.Event()
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="progress-stream", daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    def send(self, progress) -> None:
        """Queue one Progress; never blocks."""
        while True:
            try:
                self.queue.put_nowait(progress)
                return
            except queue.Full:
                try:
                    self.queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (waiting at most `timeout` seconds) and end the stream."""
        self.closed.set()
        self.send(_CLOSE)
        self.thread.join(timeout)

    def _requests(self, first, alive: threading.Event):
        """One stream's records. It stops taking from the queue once its stream is over
        (`alive` cleared): gRPC's thread may still be waiting on it, and a record it took then
        would be lost instead of going out on the next stream."""
        if first is not None:
            yield first
        while alive.is_set():
            try:
                item = self.queue.get(timeout=STALE_POLL_SECONDS)
            except queue.Empty:
                continue
            if item is _CLOSE:
                return
            self.pending = item
            yield item
            self.pending = None

    def _channel(self, grpc):
        if not self.tls_ca:
            return grpc.insecure_channel(self.address)
        with open(self.tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(self.address, credentials)

    def _run(self) -> None:
        import grpc

        from protos import launcher_pb2_grpc

        backoff, warned = 0.5, False
        self.pending = None
        metadata = [("authorization", f"Bearer {self.token}")] if self.token else None
        while not self.closed.is_set() or not self.queue.empty():
            alive = threading.Event()
            alive.set()
            try:
                with self._channel(grpc) as channel:
                    stub = launcher_pb2_grpc.LauncherStub(channel)
                    requests = self._requests(self.pending, alive)
                    try:
                        response = stub.ReportProgress(requests, metadata=metadata)
                    finally:
                        alive.clear()  # before any backoff: the next stream starts clean
                if response.stop:
                    self.log("launcher asked this job to stop: checkpointing")
                    self.stop_requested.set()
                    return
                backoff = 0.5  # the launcher ended the stream: open a new one
            except grpc.RpcError as e:
                if self.closed.is_set():
                    return
                if not warned:
                    self.log(
                        f"progress stream to {self.address} failed ({e.code().name}); retrying"
                    )
                    warned = True
                self._current = (self._current + 1) % len(self.addresses)  # it may lead now
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
