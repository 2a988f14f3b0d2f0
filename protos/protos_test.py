"""The schema round-trips and its service answers a real gRPC call on 127.0.0.1."""

from concurrent import futures

import grpc
from google.protobuf import json_format

from protos import job_pb2, launcher_pb2, launcher_pb2_grpc, trainer_config_pb2


def make_spec() -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec(name="tiny", kind=job_pb2.PRETRAIN, team="research", priority=3)
    spec.resources.pool = "cpu"
    spec.trainer.model.dim = 128
    spec.trainer.data.packing = trainer_config_pb2.BEST_FIT
    return spec


def test_job_spec_round_trips_through_bytes_and_json():
    spec = make_spec()
    assert job_pb2.JobSpec.FromString(spec.SerializeToString()) == spec
    as_json = json_format.MessageToJson(spec, preserving_proto_field_name=True)
    assert json_format.Parse(as_json, job_pb2.JobSpec()) == spec


def test_optional_fields_track_presence():
    spec = make_spec()
    assert spec.trainer.model.HasField("dim")
    assert not spec.trainer.model.HasField("n_layers")  # the trainer fills its default


class _EchoLauncher(launcher_pb2_grpc.LauncherServicer):
    def __init__(self):
        self.jobs = {}

    def SubmitJob(self, request, context):
        job = job_pb2.Job(id=f"job-{len(self.jobs) + 1}", spec=request.spec, state=job_pb2.QUEUED)
        self.jobs[job.id] = job
        return launcher_pb2.SubmitJobResponse(job=job)

    def GetJob(self, request, context):
        if request.id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.id}")
        return self.jobs[request.id]


def test_real_grpc_call_on_loopback():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    launcher_pb2_grpc.add_LauncherServicer_to_server(_EchoLauncher(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = launcher_pb2_grpc.LauncherStub(channel)
            submitted = stub.SubmitJob(launcher_pb2.SubmitJobRequest(spec=make_spec()), timeout=5)
            fetched = stub.GetJob(launcher_pb2.GetJobRequest(id=submitted.job.id), timeout=5)
            assert fetched.spec == make_spec()
            assert fetched.state == job_pb2.QUEUED
            try:
                stub.GetJob(launcher_pb2.GetJobRequest(id="missing"), timeout=5)
                raise AssertionError("expected NOT_FOUND")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=None)
