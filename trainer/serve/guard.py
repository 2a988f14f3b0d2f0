"""What stands between a client and the API (trainer/serve/api.py): the API key, the body's
size and encoding, and how long a client may take to send its request.

`Guard` is ASGI middleware: on /v1 routes it asks for the API key (`Authorization: Bearer`,
what the openai client sends as its `api_key`), compared in constant time; it reads the body
itself, refusing it as soon as it is longer than ServeConfig.max_body_bytes (a Content-Length
that says so is refused before a byte of the body is read), and refuses a body that is not
UTF-8; then it hands the body to the app. Every refusal is OpenAI's error object.

`timed_protocol` is uvicorn's h11 protocol with a request timeout: uvicorn closes a kept-alive
connection idle for `timeout_keep_alive`, but waits forever for a request's headers and body,
so a client that sends them a byte at a time (slowloris) or not at all holds its connection and
its handler. This one closes a connection whose request is not all in within
ServeConfig.request_timeout_seconds of its first byte (or of the connection, for the first).
It also closes a connection gently when the answer went out before the request was all in (a
refused body): closing a socket with unread data makes the kernel send a reset, and a reset can
reach the client before it has read the answer, so the client sees "connection reset" instead
of the 400. Like Apache's and nginx's lingering close, it sends its FIN after the answer, then
reads and drops what the client still sends for up to LINGER_SECONDS or LINGER_BYTES.
"""

import asyncio
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from trainer.serve.requests import ApiError

LINGER_SECONDS = 2.0  # a refused body is dropped for this long after the answer ...
LINGER_BYTES = 4 << 20  # ... or this much of it, whichever ends first

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def _digest(key: str | bytes) -> bytes:
    # Digests, not the keys, are compared: compare_digest is constant-time only for equal
    # lengths, and a key's length is also a secret.
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class Guard:
    def __init__(self, app: App, *, api_key: str, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self._key = _digest(api_key) if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case names (ASGI)
        if self._key is not None and scope["path"].startswith("/v1/"):
            refusal = self._refuse_key(headers.get(b"authorization", b""))
            if refusal is not None:
                return await _answer(send, refusal)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _answer(send, self._too_long(int(length)))
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await _answer(send, self._too_long(len(body), more=True))
            if not message.get("more_body", False):
                break
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            problem = f"the body is not UTF-8 text: byte {e.start} is {body[e.start]:#04x}"
            return await _answer(send, ApiError(400, problem, None))
        await self.app(scope, _replay(bytes(body), receive), send)

    def _refuse_key(self, authorization: bytes) -> ApiError | None:
        assert self._key is not None
        scheme, _, key = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(_digest(key.strip()), self._key):
            return None
        problem = (
            "incorrect API key provided"
            if authorization
            else "no API key: send it as `Authorization: Bearer <key>` (the openai client's "
            "api_key)"
        )
        return ApiError(401, problem, None, code="invalid_api_key")

    def _too_long(self, size: int, more: bool = False) -> ApiError:
        at_least = "at least " if more else ""
        return ApiError(
            400,
            f"the request body is {at_least}{size:,} bytes; this server takes at most "
            f"{self.max_body_bytes:,} (serve.max_body_bytes)",
            None,
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's `receive`: the body read, then the client's own (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _answer(send: Send, error: ApiError) -> None:
    """The error, and the connection closed after it: the rest of a refused body is not read."""
    content = json.dumps(error.body(), separators=(",", ":")).encode()  # as JSONResponse writes
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
        (b"connection", b"close"),
    ]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


class _CloseGently:
    """The transport uvicorn's request cycle holds: its close() is the protocol's lingering one."""

    def __init__(self, transport, protocol) -> None:
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        self._protocol.close_after_answer()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def timed_protocol(request_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose request is not all in (headers
    and body) within `request_timeout` seconds (uvicorn.Config(http=...)), and closes gently
    one answered before its body was all in."""

    class TimedH11Protocol(H11Protocol):
        _request_timer = None
        _dropped: int | None = None  # bytes dropped while lingering; None: not lingering

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._socket = transport
            # the request cycle takes its transport from here; all else goes to the socket's
            self.transport = cast(asyncio.Transport, _CloseGently(transport, self))
            self._arm()  # nothing sent yet is a request not in yet

        def data_received(self, data: bytes) -> None:
            if self._dropped is not None:
                self._dropped += len(data)
                if self._dropped > LINGER_BYTES:
                    self._socket.close()
                return
            super().data_received(data)
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                self._arm()  # a request begun: its clock runs from its first byte
            else:
                self._disarm()  # all in (DONE), or the connection is ending

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def close_after_answer(self) -> None:
            socket = self._socket
            if (
                self.conn.their_state is not h11.SEND_BODY
                or socket.is_closing()
                or not socket.can_write_eof()  # TLS cannot half-close
            ):
                socket.close()
                return
            self._disarm()
            self._dropped = 0
            socket.write_eof()  # after the answer, which is already queued
            socket.resume_reading()  # uvicorn pauses reading while a body waits for its app
            self.loop.call_later(LINGER_SECONDS, socket.close)

        def _arm(self) -> None:
            if self._request_timer is None:
                self._request_timer = self.loop.call_later(request_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _timed_out(self) -> None:
            self._request_timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                self._socket.close()

    return TimedH11Protocol
