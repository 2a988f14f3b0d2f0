"""Bearer tokens: who is calling, and a server interceptor that turns strangers away.

The tokens file is YAML onto `kitchen.v1.AccessTokens`:

    tokens:
      - {token: "s3cret-alice", user: alice, team: nlp}
      - {token: "s3cret-root", user: ops, team: infra, admin: true}

Clients send `authorization: Bearer <token>`. A user sees and cancels only their team's jobs;
an admin sees all. Trainers report progress with the per-attempt token the launcher gives them
(a 0600 file named in its attempt.json): any current attempt's token passes here, and the
service checks it is the token of the job the stream reports for.
"""

import hmac
from collections.abc import Callable

import grpc

from protos import launcher_pb2
from protos.config_yaml import ConfigError, load_message

OPEN_METHODS = ("/grpc.health.v1.Health/",)
# A trainer reports with its attempt's token: any current one lets the stream in, the service
# then checks it is the one of the job reported for.
TRAINER_METHODS = ("/kitchen.v1.Launcher/ReportProgress",)


def bearer(metadata) -> str:
    for key, value in metadata or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


class TokenAuth:
    def __init__(self, path: str):
        tokens = load_message(path, launcher_pb2.AccessTokens()).tokens
        for i, t in enumerate(tokens):
            if not t.token or not t.user or not t.team:
                raise ConfigError(f"tokens[{i}]", "needs token, user and team", path)
        self._by_token = {t.token: t for t in tokens}

    def identify(self, metadata) -> launcher_pb2.AccessToken | None:
        """The caller's entry, or None. Compared in constant time per candidate."""
        given = bearer(metadata)
        if not given:
            return None
        for token, entry in self._by_token.items():
            if hmac.compare_digest(token.encode(), given.encode()):
                return entry
        return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Every call but health checks needs a known token, checked before a worker thread runs
    the call: a user's, or (ReportProgress) a current attempt's (`attempt_token_known`)."""

    def __init__(self, auth: TokenAuth, attempt_token_known: Callable[[str], bool]):
        self.auth = auth
        self.attempt_token_known = attempt_token_known

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        metadata = details.invocation_metadata
        if self.auth.identify(metadata) is not None:
            return handler
        trainer = details.method.startswith(TRAINER_METHODS)
        if trainer and self.attempt_token_known(bearer(metadata)):
            return handler
        return _rejecting(handler)


def _rejecting(handler):
    def reject(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "send 'authorization: Bearer <token>'")

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject)
    return grpc.stream_stream_rpc_method_handler(reject)
