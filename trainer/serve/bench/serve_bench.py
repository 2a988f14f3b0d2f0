"""Continuous batching against one request at a time, side by side in one run, over HTTP.

    python -m trainer.serve.bench.serve_bench [--clients 1,8,32,128] [--max-tokens 64]

The same randomly initialised model (the guides' default size: dim 256, 4 layers, 8 heads,
vocab 4096, 256 positions) is served twice on 127.0.0.1: once as configured (continuous
batching, paged KV cache), once with serve.max_running 1, which is a server that runs one
request at a time. Each of N concurrent clients streams requests one after another (a prompt
of 16 tokens, exactly --max-tokens new tokens: end of text is switched off so that every
request does the same work). Client-side: generated tokens/s over the whole run, time to first
token and inter-token latency (p50/p99). Prints a markdown table.
"""

import argparse
import http.client
import json
import os
import platform
import statistics
import threading
import time

import torch

from protos import defaults, trainer_config_pb2
from trainer.model import Transformer
from trainer.serve.api import ServedModel
from trainer.serve.server import Server

VOCAB = 4096
PROMPT = "x" * 15  # with BOS: 16 tokens


def bench_model() -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.use_kernels = False  # the PyTorch reference path, as a CPU job runs
    torch.manual_seed(0)
    return Transformer(defaults.with_defaults(cfg).model, VOCAB).eval()


def start(model: Transformer, **serve) -> Server:
    cfg = trainer_config_pb2.TrainerConfig()
    for name, value in serve.items():
        setattr(cfg.serve, name, value)
    served = ServedModel("bench", lambda text: [ord(c) for c in text], 1, 256, created=0)
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731
    return Server(model, defaults.with_defaults(cfg).serve, served, decode=decode, eos_id=VOCAB)


def one_request(host: str, port: int, max_tokens: int, record: list) -> None:
    """Streams one completion; appends (arrival, [token times]) to `record`."""
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    body["temperature"] = 0
    conn = http.client.HTTPConnection(host, port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    times = []
    for line in response:
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
    conn.close()
    record.append((sent, times))


def run_level(server: Server, clients: int, requests_each: int, max_tokens: int) -> dict:
    host, port = server.sock.getsockname()
    records: list = []

    def client() -> None:
        for _ in range(requests_each):
            one_request(host, port, max_tokens, records)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start_time = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start_time
    tokens = sum(len(times) for _, times in records)
    ttft = sorted(times[0] - sent for sent, times in records)
    itl = sorted(b - a for _, times in records for a, b in zip(times, times[1:], strict=False))
    return {
        "clients": clients,
        "requests": len(records),
        "tokens_per_s": tokens / wall,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "itl_p50": _pct(itl, 50),
        "itl_p99": _pct(itl, 99),
    }


def _pct(values: list[float], p: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,8,32,128")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=256, help="about this many per level")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = bench_model()
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    serial = start(model, max_running=1, max_waiting=1024).start()
    base = run_level(serial, 1, max(4, args.requests // 32), args.max_tokens)
    rows.append(("one at a time (max_running 1)", base))
    if 32 in levels:
        rows.append(("one at a time (max_running 1)", run_level(serial, 32, 1, args.max_tokens)))
    serial.stop()
    batched = start(model, max_running=128, max_batch_tokens=2048, max_waiting=1024).start()
    for clients in levels:
        each = max(1, args.requests // clients) if clients > 1 else max(4, args.requests // 32)
        rows.append(("continuous batching", run_level(batched, clients, each, args.max_tokens)))
    batched.stop()
    print(
        f"# serve bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; prompt 16 tokens, "
        f"{args.max_tokens} new tokens per request\n"
    )
    print("| server | clients | requests | tokens/s | x one-at-a-time | TTFT p50 / p99 (s) "
          "| inter-token p50 / p99 (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.1f}x | {r['ttft_p50']:.3f} / "
            f"{r['ttft_p99']:.3f} | {1000 * r['itl_p50']:.1f} / {1000 * r['itl_p99']:.1f} |"
        )


if __name__ == "__main__":
    main()
