"""How many streams a caller may hold, so that no client can take every worker thread.

Each streaming RPC (WatchJob, StreamLogs, ReportProgress) holds one of the server's worker
threads for as long as it is open. Without a bound, 520 idle streams took all 512 and every
other caller's GetJob timed out. `StreamLimits` (kitchen.v1.StreamLimits, resolved in
launcher/settings.py) caps the streams of one caller (a user, or one attempt's token) and of
all callers together, below the worker count, so unary calls always find a thread; a stream
over a cap ends at once with RESOURCE_EXHAUSTED. A ReportProgress stream that sends nothing
for `idle_seconds` is cancelled (a trainer's client reconnects). A stream over a cap gives its
worker back as soon as it starts; one without a valid token never gets past AuthInterceptor.
"""

import hashlib
import threading
import time

import grpc

from launcher.auth import TokenAuth, bearer
from protos import launcher_pb2


class Streams:
    """Open streams by caller, and the idle time of each client stream (thread-safe)."""

    def __init__(self, limits: launcher_pb2.StreamLimits, clock=time.monotonic):
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()
        self._by_caller: dict[str, int] = {}
        self._idle: dict[int, list] = {}  # id(context) -> [context, last activity]
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="stream-idle", daemon=True)
        self._sweeper.start()

    def acquire(self, caller: str) -> str:
        """ "" if `caller` may open one more stream, else why not."""
        with self._lock:
            mine = self._by_caller.get(caller, 0)
            if mine >= self.limits.per_caller:
                return f"{caller} holds {mine} streams already (streams.per_caller)"
            if sum(self._by_caller.values()) >= self.limits.total:
                return f"the launcher holds {self.limits.total} streams (streams.total)"
            self._by_caller[caller] = mine + 1
            return ""

    def release(self, caller: str):
        with self._lock:
            left = self._by_caller.get(caller, 1) - 1
            if left:
                self._by_caller[caller] = left
            else:
                self._by_caller.pop(caller, None)

    def open_count(self) -> int:
        with self._lock:
            return sum(self._by_caller.values())

    def watch(self, context) -> list:
        entry = [context, self.clock()]
        with self._lock:
            self._idle[id(context)] = entry
        return entry

    def unwatch(self, context):
        with self._lock:
            self._idle.pop(id(context), None)

    def _sweep(self):
        while not self._stop.wait(max(0.05, self.limits.idle_seconds / 4)):
            now = self.clock()
            with self._lock:
                limit = self.limits.idle_seconds
                idle = [c for c, last in self._idle.values() if now - last > limit]
            for context in idle:
                context.cancel()

    def close(self):
        self._stop.set()


class LimitInterceptor(grpc.ServerInterceptor):
    """Counts every streaming call against its caller's and the launcher's caps."""

    def __init__(self, streams: Streams, auth: TokenAuth | None):
        self.streams = streams
        self.auth = auth

    def caller(self, details) -> str:
        token = bearer(details.invocation_metadata)
        entry = self.auth.identify(details.invocation_metadata) if self.auth else None
        if entry is not None:
            return f"user {entry.user}"
        if token:  # an attempt's token (checked already by AuthInterceptor): that attempt
            return "attempt " + hashlib.sha256(token.encode()).hexdigest()[:12]
        return "anonymous"

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not (handler.unary_stream or handler.stream_unary):
            return handler
        caller = self.caller(details)
        streams = self.streams
        options = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_stream:
            inner = handler.unary_stream

            def pushing(request, context):
                refused = streams.acquire(caller)
                if refused:
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
                try:
                    yield from inner(request, context)
                finally:
                    streams.release(caller)

            return grpc.unary_stream_rpc_method_handler(pushing, **options)
        received = handler.stream_unary

        def receiving(request_iterator, context):
            refused = streams.acquire(caller)
            if refused:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            entry = streams.watch(context)

            def touched():
                for message in request_iterator:
                    entry[1] = streams.clock()
                    yield message

            try:
                return received(touched(), context)
            finally:
                streams.unwatch(context)
                streams.release(caller)

        return grpc.stream_unary_rpc_method_handler(receiving, **options)
