"""Continuous batching against one request at a time, side by side in one run, over HTTP.

    python -m trainer.serve.bench.serve_bench [--clients 1,8,32,128] [--max-tokens 64]

The same randomly initialised model (the shape docs/serve.md serves: dim 128, 2 layers, 4
heads, vocab 4096, 128 positions) is served twice on 127.0.0.1: once as configured (continuous
batching, paged KV cache), once with serve.max_running 1, which is a server that runs one
request at a time. Each of N concurrent clients streams requests one after another (a prompt
of 16 tokens, exactly --max-tokens new tokens: end of text is switched off so that every
request does the same work). Client-side: generated tokens/s over the whole run, time to first
token and inter-token latency (p50/p99), and, from the server process, generated tokens per
CPU-second: on a shared machine whose load swings during a run (wall-clock throughput of the
same work varied 10x between minutes here), CPU time is what the server itself spent, and the
ratios are taken on it. Both servers are warmed up first; one-at-a-time is measured first and
last, and ratios are to the better of the two. Prints a markdown table.
"""

import argparse
import multiprocessing
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from protos import defaults, trainer_config_pb2
from trainer.model import Transformer
from trainer.serve.api import ServedModel
from trainer.serve.bench.load import Result, run_clients, summarize
from trainer.serve.server import Server

VOCAB = 4096
PROMPT = "x" * 15  # with BOS: 16 tokens


def bench_model() -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.max_seq_len = 128, 2, 4, 128
    cfg.model.use_kernels = False  # the PyTorch reference path, as a CPU job runs
    torch.manual_seed(0)
    return Transformer(defaults.with_defaults(cfg).model, VOCAB).eval()


def start(model: Transformer, **serve) -> Server:
    cfg = trainer_config_pb2.TrainerConfig()
    for name, value in serve.items():
        setattr(cfg.serve, name, value)
    served = ServedModel("bench", lambda text: [ord(c) for c in text], 1, 128, created=0)
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731
    return Server(model, defaults.with_defaults(cfg).serve, served, decode=decode, eos_id=VOCAB)


@dataclass(frozen=True)
class Level:
    result: Result
    tokens_per_cpu_second: float  # of the server process (the clients run in another one)


def run_level(
    pool: ProcessPoolExecutor, server: Server, clients: int, each: int, max_tokens: int
) -> Level:
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    cpu = time.process_time()
    wall, records = pool.submit(run_clients, server.endpoint, body, clients, each).result()
    cpu = time.process_time() - cpu
    return Level(summarize(clients, wall, records), sum(r.tokens for r in records) / cpu)


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
    # The clients run in a process of their own: the server's GIL is not theirs.
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    serial = start(model, max_running=1, max_waiting=1024).start()
    batched = start(model, max_running=128, max_batch_tokens=2048, max_waiting=1024).start()
    for server in (serial, batched):  # warm-up (first forwards, allocator), not measured
        run_level(pool, server, 4, 1, args.max_tokens)
    one = max(8, args.requests // 16)
    base = run_level(pool, serial, 1, one, args.max_tokens)
    rows.append(("one at a time (max_running 1)", base))
    if 32 in levels:  # the same load as the batching row at 32: how much queueing costs
        queued = run_level(pool, serial, 32, 1, args.max_tokens)
        rows.append(("one at a time (max_running 1)", queued))
    for clients in levels:
        each = max(1, args.requests // clients) if clients > 1 else one
        rows.append(
            ("continuous batching", run_level(pool, batched, clients, each, args.max_tokens))
        )
    # Again at the end: the machine's load may have changed; ratios are to the faster one.
    again = run_level(pool, serial, 1, one, args.max_tokens)
    rows.append(("one at a time (max_running 1), again", again))
    base = max(base, again, key=lambda level: level.tokens_per_cpu_second)
    serial.stop()
    batched.stop()
    pool.shutdown()
    print(
        f"# serve bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; prompt 16 tokens, "
        f"{args.max_tokens} new tokens per request\n"
    )
    print(
        "| server | clients | requests | tokens/s (wall) | tokens per server CPU-second | "
        "x one at a time (CPU) | TTFT p50 / p99 (s) | inter-token p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, level in rows:
        r = level.result
        print(
            f"| {name} | {r.clients} | {r.requests} | {r.tokens_per_s:,.0f} | "
            f"{level.tokens_per_cpu_second:,.0f} | "
            f"{level.tokens_per_cpu_second / base.tokens_per_cpu_second:.1f}x | "
            f"{r.ttft_p50:.3f} / {r.ttft_p99:.3f} | "
            f"{1000 * r.itl_p50:.1f} / {1000 * r.itl_p99:.1f} |"
        )


if __name__ == "__main__":
    main()
