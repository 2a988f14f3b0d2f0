"""A small client of the launcher for the CLI, `submit` and tests.

Address, token and TLS root come from arguments or the environment: KITCHEN_LAUNCHER
(default 127.0.0.1:50051), KITCHEN_TOKEN, KITCHEN_TLS_CA (PEM file; TLS on when set).
SubmitJob is retried on UNAVAILABLE with the same request_id, so a retry never makes a
second job.
"""

import os
import time
import uuid

import grpc

from launcher.settings import DEFAULT_LISTEN
from protos import launcher_pb2, launcher_pb2_grpc

SUBMIT_RETRIES = 5


class Client:
    def __init__(self, address=None, token=None, tls_ca=None):
        self.address = address or os.environ.get("KITCHEN_LAUNCHER") or DEFAULT_LISTEN
        token = token or os.environ.get("KITCHEN_TOKEN")
        tls_ca = tls_ca or os.environ.get("KITCHEN_TLS_CA")
        if tls_ca:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(f.read())
            self.channel = grpc.secure_channel(self.address, creds)
        else:
            self.channel = grpc.insecure_channel(self.address)
        self.stub = launcher_pb2_grpc.LauncherStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    def close(self):
        self.channel.close()

    def submit(self, spec, request_id=None, timeout=30.0):
        request = launcher_pb2.SubmitJobRequest(
            spec=spec, request_id=request_id or uuid.uuid4().hex
        )
        for attempt in range(SUBMIT_RETRIES):
            try:
                return self.stub.SubmitJob(request, timeout=timeout, metadata=self.metadata).job
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == SUBMIT_RETRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def get(self, job_id, timeout=30.0):
        request = launcher_pb2.GetJobRequest(id=job_id)
        return self.stub.GetJob(request, timeout=timeout, metadata=self.metadata)

    def list(self, timeout=30.0, **filters):
        request = launcher_pb2.ListJobsRequest(**filters)
        return self.stub.ListJobs(request, timeout=timeout, metadata=self.metadata)

    def cancel(self, job_id, timeout=60.0):
        request = launcher_pb2.CancelJobRequest(id=job_id)
        return self.stub.CancelJob(request, timeout=timeout, metadata=self.metadata)

    def watch(self, job_id):
        request = launcher_pb2.WatchJobRequest(id=job_id)
        return self.stub.WatchJob(request, metadata=self.metadata)

    def logs(self, job_id, follow=False):
        request = launcher_pb2.StreamLogsRequest(id=job_id, follow=follow)
        return self.stub.StreamLogs(request, metadata=self.metadata)

    def wait_ready(self, timeout=10.0):
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
