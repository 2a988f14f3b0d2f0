"""The standard gRPC health service (grpc.health.v1.Health: Check and Watch).

grpcio-health-checking is not in the lock, so the two messages are built here from their
descriptor (they are tiny and frozen by the gRPC spec); any health client (grpc_health_probe,
Kubernetes gRPC probes) talks to it unchanged. The service name "" and "kitchen.v1.Launcher"
are SERVING while the launcher runs and NOT_SERVING once shutdown has begun.
"""

import threading

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "grpc.health.v1.Health"
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def _messages():
    f = descriptor_pb2.FileDescriptorProto(
        name="grpc/health/v1/health.proto", package="grpc.health.v1"
    )
    request = f.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=9, label=1)  # string
    response = f.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for name, number in (
        ("UNKNOWN", 0),
        ("SERVING", 1),
        ("NOT_SERVING", 2),
        ("SERVICE_UNKNOWN", 3),
    ):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=14,
        label=1,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return (
        get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _messages()


class Health:
    def __init__(self, services=("", "kitchen.v1.Launcher")):
        self._status = dict.fromkeys(services, SERVING)
        self._changed = threading.Condition()

    def set_all(self, status: int):
        with self._changed:
            self._status = dict.fromkeys(self._status, status)
            self._changed.notify_all()

    def _get(self, service):
        return self._status.get(service, SERVICE_UNKNOWN)

    def check(self, request, context):
        if request.service not in self._status:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=self._get(request.service))

    def watch(self, request, context):
        last = None
        while context.is_active():
            with self._changed:
                status = self._get(request.service)
                if status == last:
                    self._changed.wait(1.0)
                    continue
            last = status
            yield HealthCheckResponse(status=status)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.check,
                    request_deserializer=HealthCheckRequest.FromString,
                    response_serializer=HealthCheckResponse.SerializeToString,
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    request_deserializer=HealthCheckRequest.FromString,
                    response_serializer=HealthCheckResponse.SerializeToString,
                ),
            },
        )


def check(channel: grpc.Channel, service: str = "", timeout: float = 5.0) -> int:
    """A client-side Check: the ServingStatus number (1 = SERVING)."""
    call = channel.unary_unary(
        f"/{SERVICE}/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
    return call(HealthCheckRequest(service=service), timeout=timeout).status
