"""Continuous batching against one request at a time, side by side in one run, over HTTP.

    python -m trainer.bench.serve_bench [--clients 1,8,32,128] [--max-tokens 64] \\
        [--rounds 3]

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
last, and ratios are to the better of the two. Prints a markdown table per round (--rounds
repeats the whole comparison on the same two servers) and the spread of the ratios at 32
clients.
"""

import argparse
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from protos import defaults, trainer_config_pb2
from trainer.bench.machine import cpu_ticks, machine, stolen_share
from trainer.bench.serve_load import Result, run_clients, summarize
from trainer.model import Transformer
from trainer.serve.api import ServedModel
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
    served = ServedModel("bench", encode, 1, 128, created=0)
    return Server(model, defaults.with_defaults(cfg).serve, served, decode=decode, eos_id=VOCAB)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:  # a module's function: the engine process unpickles it
    return "".join(chr(97 + i % 26) for i in ids)


@dataclass(frozen=True)
class Level:
    result: Result
    tokens_per_cpu_second: float  # of the server's two processes (the clients run in a third)
    engine_us_per_token: float  # CPU of the engine process (model steps, scheduling, outputs)
    http_us_per_token: float  # CPU of the HTTP process (asyncio, uvicorn, SSE events)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_level(
    pool: ProcessPoolExecutor, server: Server, clients: int, each: int, max_tokens: int
) -> Level:
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    engine_pid = server.runner.process.pid
    assert engine_pid is not None
    http, engine = time.process_time(), process_cpu(engine_pid)
    wall, records = pool.submit(run_clients, server.endpoint, body, clients, each).result()
    http, engine = time.process_time() - http, process_cpu(engine_pid) - engine
    tokens = sum(r.tokens for r in records)
    result = summarize(clients, wall, records)
    return Level(result, tokens / (http + engine), 1e6 * engine / tokens, 1e6 * http / tokens)


@dataclass(frozen=True)
class Round:
    rows: list[tuple[str, Level]]
    base: Level  # the better one-at-a-time run with 1 client (the CPU ratios' base)
    load: float  # the machine's 1-minute load average when the round ended
    steal: float  # the share of CPU time the hypervisor took during the round


def one_round(
    pool: ProcessPoolExecutor, serial: Server, batched: Server, levels: list[int], args
) -> Round:
    rows = []
    ticks = cpu_ticks()
    one = max(8, args.requests // 16)
    base = run_level(pool, serial, 1, one, args.max_tokens)
    rows.append(("one at a time (max_running 1)", base))
    for clients in levels:
        if clients == 32:  # the same load on one at a time, run right before (the machine's
            # speed drifts over a round): what batching gains, and what queueing costs
            queued = run_level(pool, serial, 32, 1, args.max_tokens)
            rows.append(("one at a time (max_running 1)", queued))
        each = max(1, args.requests // clients) if clients > 1 else one
        rows.append(
            ("continuous batching", run_level(pool, batched, clients, each, args.max_tokens))
        )
    # Again at the end: the machine's load may have changed; ratios are to the faster one.
    again = run_level(pool, serial, 1, one, args.max_tokens)
    rows.append(("one at a time (max_running 1), again", again))
    base = max(base, again, key=lambda level: level.tokens_per_cpu_second)
    return Round(rows, base, os.getloadavg()[0], stolen_share(ticks, cpu_ticks()))


def print_round(number: int, r: Round) -> None:
    print(
        f"\nRound {number} (load average {r.load:.1f} at its end; {100 * r.steal:.0f}% of the "
        "CPU time stolen by the hypervisor):\n"
    )
    print(
        "| server | clients | requests | tokens/s (wall) | tokens per server CPU-second | "
        "x one at a time (CPU) | CPU per token: engine / HTTP process (us) | "
        "TTFT p50 / p99 (s) | inter-token p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, level in r.rows:
        x = level.result
        print(
            f"| {name} | {x.clients} | {x.requests} | {x.tokens_per_s:,.0f} | "
            f"{level.tokens_per_cpu_second:,.0f} | "
            f"{level.tokens_per_cpu_second / r.base.tokens_per_cpu_second:.1f}x | "
            f"{level.engine_us_per_token:.0f} / {level.http_us_per_token:.0f} | "
            f"{x.ttft_p50:.3f} / {x.ttft_p99:.3f} | "
            f"{1000 * x.itl_p50:.1f} / {1000 * x.itl_p99:.1f} |"
        )


def ratios_at_32(r: Round) -> tuple[float, float]:
    """Continuous batching at 32 clients against one at a time under the same 32 clients
    (tokens/s, wall), and against the one-at-a-time base (tokens per CPU-second)."""
    serial = next(lv for name, lv in r.rows if name.startswith("one") and lv.result.clients == 32)
    batched = next(lv for name, lv in r.rows if name.startswith("cont") and lv.result.clients == 32)
    wall = batched.result.tokens_per_s / serial.result.tokens_per_s
    return wall, batched.tokens_per_cpu_second / r.base.tokens_per_cpu_second


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,8,32,128")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=256, help="about this many per level")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = bench_model()
    levels = [int(c) for c in args.clients.split(",")]
    # The clients run in a process of their own: the server's GIL is not theirs.
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    serial = start(model, max_running=1, max_waiting=1024).start()
    batched = start(model, max_running=128, max_batch_tokens=2048, max_waiting=1024).start()
    load = os.getloadavg()[0]
    for server in (serial, batched):  # warm-up (first forwards, allocator), not measured
        run_level(pool, server, 4, 1, args.max_tokens)
    rounds = [one_round(pool, serial, batched, levels, args) for _ in range(args.rounds)]
    serial.stop()
    batched.stop()
    pool.shutdown()
    print(
        f"# serve bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
        f"{load:.1f} at the start; prompt 16 tokens, {args.max_tokens} new tokens per request"
    )
    for number, r in enumerate(rounds, 1):
        print_round(number, r)
    if 32 in levels:
        walls, cpus = zip(*(ratios_at_32(r) for r in rounds), strict=True)
        print(
            f"\nAt 32 clients, continuous batching against one at a time, over {len(rounds)} "
            f"round(s): tokens/s (wall) {_spread(walls)}; tokens per server CPU-second "
            f"{_spread(cpus)}"
        )


def _spread(values) -> str:
    values = sorted(values)
    if len(values) == 1:
        return f"{values[0]:.1f}x"
    median = statistics.median(values)
    return f"median {median:.1f}x (min {values[0]:.1f}x, max {values[-1]:.1f}x)"


if __name__ == "__main__":
    main()
