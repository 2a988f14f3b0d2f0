"""Load a running serve job: N concurrent clients, each streaming requests one after another.

    python -m trainer.bench.serve_load --endpoint http://127.0.0.1:8321 --model NAME \\
        [--clients 8] [--requests 32] [--max-tokens 32] [--prompt TEXT] [--wait 300]

Prints generated tokens/s over the run, time to first token and inter-token latency (p50/p99),
measured at the client. Tokens are counted by the server (`stream_options.include_usage`).
"""

import argparse
import bisect
import json
import selectors
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from protos.exposure import read_secret_file
from trainer.serve.endpoint import wait_healthy


@dataclass
class Record:
    sent: float
    chunk_times: list[float]  # arrival of every chunk that carried text
    tokens: int  # as the server counted them


@dataclass
class Result:
    clients: int
    requests: int
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


def run_clients(
    endpoint: str, body: dict | list[dict], clients: int, each: int, api_key: str = ""
) -> tuple[float, list[Record]]:
    """`clients` connections at once, each sending `each` requests in turn: (wall seconds,
    records). `body`: every request's, or a list whose bodies the requests take in turn. A
    connection is kept alive from one request to the next, as the openai client's connection
    pool (httpx) and vLLM's benchmark (aiohttp) keep theirs: a connection per
    request would add a TCP accept and close to every request, paid by the server's HTTP
    process. All on one thread over epoll: the load generator shares the machine it measures,
    and a thread per client (each woken for every token) cost as much CPU as the server's HTTP
    side; one thread reading whatever has arrived on every ready socket costs a fraction.
    `api_key`: sent as `Authorization: Bearer` (a server with serve.api_key_file)."""
    url = urlparse(endpoint)
    address = (url.hostname or "127.0.0.1", url.port or 80)
    requests = []
    for b in body if isinstance(body, list) else [body]:
        payload = json.dumps({**b, "stream": True, "stream_options": {"include_usage": True}})
        requests.append(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
                "Content-Type: application/json\r\n"
                + (f"Authorization: Bearer {api_key}\r\n" if api_key else "")
                + f"Content-Length: {len(payload.encode())}\r\n\r\n{payload}"
            ).encode()
        )
    sent = [0]
    selector = selectors.DefaultSelector()
    done: list[_Stream] = []  # parsed after the run: the parsing is not the server's time
    left = [each] * clients

    def send(client: int, sock: socket.socket | None) -> None:
        """The client's next request, on `sock` (kept alive) or on a new connection (None)."""
        stream = _Stream(time.perf_counter())
        if sock is None:
            sock = socket.create_connection(address, timeout=600)
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, (client, stream))
        else:
            selector.modify(sock, selectors.EVENT_READ, (client, stream))
        request = requests[sent[0] % len(requests)]
        sent[0] += 1
        sock.sendall(request)  # a few kilobytes at most: the socket's buffer takes them at once

    start = time.perf_counter()
    for client in range(clients):
        send(client, None)
    while selector.get_map():
        for key, _ in selector.select():
            sock, (client, stream) = key.fileobj, key.data
            data = sock.recv(1 << 16)  # type: ignore[union-attr]
            if data:
                stream.arrived(data, time.perf_counter())
            if not stream.complete():
                if data:
                    continue
                raise RuntimeError(f"the server closed the connection mid-response: {stream}")
            done.append(stream)
            left[client] -= 1
            if data and left[client] and not stream.close:
                send(client, sock)  # type: ignore[arg-type]
                continue
            selector.unregister(sock)
            sock.close()  # type: ignore[union-attr]
            if left[client]:
                send(client, None)
    wall = time.perf_counter() - start
    return wall, [stream.record() for stream in done]


class _Stream:
    """One response as it arrives: its bytes, and when each recv's bytes came."""

    def __init__(self, sent: float):
        self.sent = sent
        self.raw = bytearray()
        self.arrivals: list[tuple[int, float]] = []  # (bytes received so far, time)
        self.body_at: int | None = None  # where the body starts in raw, once the head is in
        self.length: int | None = None  # Content-Length, when the body is not chunked
        self.close = False  # the server closes the connection after this response

    def arrived(self, data: bytes, now: float) -> None:
        self.raw += data
        self.arrivals.append((len(self.raw), now))

    def complete(self) -> bool:
        """Whether the whole response is in: a chunked body's last chunk, or Content-Length
        bytes of body (an error's JSON). Called on every recv: the head is parsed once."""
        if self.body_at is None:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return False
            self.body_at, head = end + 4, bytes(self.raw[:end])
            length = _header(head, b"content-length")
            self.length = None if length is None else int(length)
            self.close = _header(head, b"connection") == b"close"
        if self.length is not None:
            return len(self.raw) - self.body_at >= self.length
        return self.raw.endswith(b"0\r\n\r\n")

    def __str__(self) -> str:
        return repr(bytes(self.raw)[:300])

    def record(self) -> Record:
        """The response parsed once it is complete: every event carrying text is timed by the
        recv that brought its last byte; the token count is the server's (usage)."""
        head, _, rest = bytes(self.raw).partition(b"\r\n\r\n")
        status = head.split(b" ", 2)[1] if head.startswith(b"HTTP/") else b"?"
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {bytes(self.raw)[:300]!r}")
        offset = len(head) + 4  # where the body starts in self.raw
        times, tokens = [], 0
        for end, event in _events(rest):
            chunk = json.loads(event)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"][0]["text"]:
                times.append(self._time_of(offset + end))
        return Record(self.sent, times, tokens)

    def _time_of(self, position: int) -> float:
        i = bisect.bisect_left(self.arrivals, position, key=lambda a: a[0])
        return self.arrivals[i][1]


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` (lowercase) in a response's head, None when absent."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().lower()
    return None


def _events(body: bytes):
    """(end of the event in `body`, its JSON) for every `data: {...}` server-sent event of a
    chunked HTTP body."""
    at, pending = 0, b""
    while True:
        line_end = body.index(b"\r\n", at)
        size = int(body[at:line_end].split(b";")[0], 16)
        if size == 0:
            return
        start = line_end + 2
        carried = len(pending)  # bytes of an event begun in earlier chunks
        pending += body[start : start + size]
        # Events end with a blank line; an event split across chunks waits for its rest.
        *done, pending = pending.split(b"\n\n")
        end = start - carried
        for event in done:
            end += len(event) + 2
            if event.startswith(b"data: {"):
                yield end, event[6:]
        at = start + size + 2


def summarize(clients: int, wall: float, records: list[Record]) -> Result:
    ttft = [r.chunk_times[0] - r.sent for r in records if r.chunk_times]
    itl = [b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tokens = sum(r.tokens for r in records)
    return Result(clients, len(records), tokens / wall, *_p50_p99(ttft), *_p50_p99(itl))


def _p50_p99(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[98]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="http://host:port of the serve job")
    p.add_argument("--model", required=True, help="the served model's name (/v1/models)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32, help="in all, spread over the clients")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="What does os.path.join() do?\n")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for /health first")
    p.add_argument(
        "--api-key-file", help="a file holding the server's API key (serve.api_key_file)"
    )
    args = p.parse_args(argv)
    key = read_secret_file(args.api_key_file, "--api-key-file") if args.api_key_file else ""
    endpoint = args.endpoint.rstrip("/")
    if args.wait:
        wait_healthy(endpoint, args.wait)
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens}
    body["temperature"] = 0.8
    each = max(1, args.requests // args.clients)
    r = summarize(args.clients, *run_clients(endpoint, body, args.clients, each, key))
    print(
        f"{r.requests} requests from {r.clients} clients: {r.tokens_per_s:,.0f} generated "
        f"tokens/s; time to first token p50 {r.ttft_p50:.3f} s, p99 {r.ttft_p99:.3f} s; "
        f"inter-token p50 {1000 * r.itl_p50:.1f} ms, p99 {1000 * r.itl_p99:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
