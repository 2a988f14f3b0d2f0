"""A small client of the launcher for the CLI, `submit` and tests.

Address, token and TLS root come from arguments or the environment: KITCHEN_LAUNCHER
(default 127.0.0.1:50051), KITCHEN_TOKEN, KITCHEN_TLS_CA (PEM file; TLS on when set).
SubmitJob is retried on UNAVAILABLE with the same request_id, so a retry never makes a
second job.

The address may name several launcher replicas, comma-separated ("h1:50051,h2:50051"): a
unary call answered UNAVAILABLE (a replica down, or one that has not opened yet) goes to the
next one; streams use the replica that answered last.
"""

import os
import time
import uuid

import grpc

from launcher.settings import DEFAULT_LISTEN
from protos import launcher_addresses, launcher_pb2, launcher_pb2_grpc

SUBMIT_RETRIES = 5


class Client:
    def __init__(self, address=None, token=None, tls_ca=None):
        self.address = address or os.environ.get("KITCHEN_LAUNCHER") or DEFAULT_LISTEN
        self.addresses = launcher_addresses.split(self.address)
        if not self.addresses:
            raise ValueError(f"launcher address: none in {self.address!r}")
        token = token or os.environ.get("KITCHEN_TOKEN")
        self._creds = None
        tls_ca = tls_ca or os.environ.get("KITCHEN_TLS_CA")
        if tls_ca:
            with open(tls_ca, "rb") as f:
                self._creds = grpc.ssl_channel_credentials(f.read())
        self._channels: dict[str, grpc.Channel] = {}
        self._current = 0
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            if self._creds is not None:
                self._channels[address] = grpc.secure_channel(address, self._creds)
            else:
                self._channels[address] = grpc.insecure_channel(address)
        return self._channels[address]

    @property
    def channel(self) -> grpc.Channel:
        """The channel of the replica that answered last (the first before any call)."""
        return self._channel(self.addresses[self._current])

    @property
    def stub(self) -> launcher_pb2_grpc.LauncherStub:
        return launcher_pb2_grpc.LauncherStub(self.channel)

    def _call(self, method: str, request, timeout: float):
        """One unary call; on UNAVAILABLE the next address is tried, each once."""
        last: grpc.RpcError | None = None
        for _ in range(len(self.addresses)):
            try:
                return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or len(self.addresses) == 1:
                    raise
                last = e
                self.next_replica()
        assert last is not None
        raise last

    def next_replica(self):
        """Sends the next calls and streams to the next address (a stream that failed
        UNAVAILABLE: live_view.follow reconnects through here)."""
        self._current = (self._current + 1) % len(self.addresses)

    def close(self):
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def submit(self, spec, request_id=None, timeout=30.0):
        request = launcher_pb2.SubmitJobRequest(
            spec=spec, request_id=request_id or uuid.uuid4().hex
        )
        for attempt in range(SUBMIT_RETRIES):
            try:
                return self._call("SubmitJob", request, timeout).job
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == SUBMIT_RETRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def get(self, job_id, timeout=30.0):
        request = launcher_pb2.GetJobRequest(id=job_id)
        return self._call("GetJob", request, timeout)

    def list(self, timeout=30.0, **filters):
        request = launcher_pb2.ListJobsRequest(**filters)
        return self._call("ListJobs", request, timeout)

    def cancel(self, job_id, timeout=60.0):
        request = launcher_pb2.CancelJobRequest(id=job_id)
        return self._call("CancelJob", request, timeout)

    def watch(self, job_id):
        request = launcher_pb2.WatchJobRequest(id=job_id)
        return self.stub.WatchJob(request, metadata=self.metadata)

    def logs(self, job_id, follow=False):
        request = launcher_pb2.StreamLogsRequest(id=job_id, follow=follow)
        return self.stub.StreamLogs(request, metadata=self.metadata)

    def wait_ready(self, timeout=10.0):
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
