"""Load a running serve job: N concurrent clients, each streaming requests one after another.

    python -m trainer.serve.bench.load --endpoint http://127.0.0.1:8321 --model NAME \\
        [--clients 8] [--requests 32] [--max-tokens 32] [--prompt TEXT] [--wait 300]

Prints generated tokens/s over the run, time to first token and inter-token latency (p50/p99),
measured at the client. Tokens are counted by the server (`stream_options.include_usage`).
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse


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


def one_request(endpoint: str, body: dict) -> Record:
    url = urlparse(endpoint)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=600)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    times, tokens = [], 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"][0]["text"]:
            times.append(time.perf_counter())
    conn.close()
    return Record(sent, times, tokens)


def run_clients(endpoint: str, body: dict, clients: int, each: int) -> tuple[float, list[Record]]:
    """`clients` threads, each sending `each` requests in turn: (wall seconds, records)."""
    records: list[Record] = []

    def client() -> None:
        for _ in range(each):
            records.append(one_request(endpoint, body))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, records


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


def wait_healthy(endpoint: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {endpoint}/health did not answer within {seconds:.0f} s")
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="http://host:port of the serve job")
    p.add_argument("--model", required=True, help="the served model's name (/v1/models)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32, help="in all, spread over the clients")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="What does os.path.join() do?\n")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for /health first")
    args = p.parse_args(argv)
    endpoint = args.endpoint.rstrip("/")
    if args.wait:
        wait_healthy(endpoint, args.wait)
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens}
    body["temperature"] = 0.8
    each = max(1, args.requests // args.clients)
    r = summarize(args.clients, *run_clients(endpoint, body, args.clients, each))
    print(
        f"{r.requests} requests from {r.clients} clients: {r.tokens_per_s:,.0f} generated "
        f"tokens/s; time to first token p50 {r.ttft_p50:.3f} s, p99 {r.ttft_p99:.3f} s; "
        f"inter-token p50 {1000 * r.itl_p50:.1f} ms, p99 {1000 * r.itl_p99:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
