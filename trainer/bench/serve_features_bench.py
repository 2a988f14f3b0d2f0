"""Prefix caching and chunked prefill, each on against off, side by side in one run, over HTTP.

    python -m trainer.bench.serve_features_bench [--rounds 3]

One randomly initialised model (dim 128, 2 layers, 4 heads, vocab 4096, 2,304 positions) is
served on 127.0.0.1 by servers that differ in one setting; clients stream from a process of
their own (load.py's generator). End of text is switched off: every request does the same work.

- Prefix cache: 32 clients, 4 requests each; every prompt is one 512-token system prompt and
  a question of its own (16 tokens), 32 new tokens. Time to first token (p50) and generated
  tokens/s, serve.prefix_caching on and off.
- Chunked prefill: 16 clients stream (16-token prompts, 128 new tokens each, 2 requests in
  turn) while a 17th client sends 2,048-token prompts (1 new token) one after another. The 16
  streams' inter-token latency (p50 / p99) with serve.chunked_prefill on and off, and with no
  long prompt arriving (the baseline). Prefix caching is off on these servers: each long
  prompt is computed.

Prints one table per round and the ratios: the issue's goals are a TTFT at least 3x lower
with the cache, and an ITL p99 with chunked prefill at most 2x the no-arrival value.
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
from trainer.bench.machine import machine
from trainer.bench.serve_bench import decode, encode
from trainer.bench.serve_load import Result, run_clients, summarize
from trainer.model import Transformer
from trainer.serve.api import ServedModel
from trainer.serve.server import Server

VOCAB = 4096
MAX_LEN = 2304
SYSTEM = "".join(chr(97 + (i * 7) % 26) for i in range(511))  # with BOS: 512 tokens
LONG = "".join(chr(97 + (i * 11) % 26) for i in range(2047))  # with BOS: 2,048 tokens


def bench_model() -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 128, 2, 4
    cfg.model.max_seq_len, cfg.model.use_kernels = MAX_LEN, False
    torch.manual_seed(0)
    return Transformer(defaults.with_defaults(cfg).model, VOCAB).eval()


def start(model: Transformer, **serve) -> Server:
    cfg = trainer_config_pb2.TrainerConfig()
    # A pool that holds every request at once, with or without sharing: the cache's gain
    # measured here is compute, not room.
    cfg.serve.max_running, cfg.serve.max_waiting, cfg.serve.num_blocks = 64, 1024, 2048
    for name, value in serve.items():
        setattr(cfg.serve, name, value)
    served = ServedModel("bench", encode, 1, MAX_LEN, created=0)
    server = Server(model, defaults.with_defaults(cfg).serve, served, decode=decode, eos_id=VOCAB)
    return server.start()


def questions(n: int) -> list[dict]:
    """n requests: the shared system prompt, then a 16-token question of each's own."""
    return [
        {"model": "bench", "prompt": SYSTEM + f"question {i:06d}.", "max_tokens": 32}
        for i in range(n)
    ]


def long_prompts(endpoint: str, seconds: float) -> int:
    """2,048-token prompts one after another for `seconds`: how many were answered."""
    deadline, sent = time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline:
        body = {"model": "bench", "prompt": LONG[:-6] + f"{sent:06d}", "max_tokens": 1}
        run_clients(endpoint, body, 1, 1)
        sent += 1
    return sent


@dataclass(frozen=True)
class Round:
    cache_on: Result
    cache_off: Result
    alone: Result  # the 16 streams, no long prompt arriving
    chunked: Result
    unchunked: Result
    long_chunked: int  # long prompts answered while the streams ran
    long_unchunked: int


def streams(
    pool: ProcessPoolExecutor, server: Server, long_for: float
) -> tuple[Result, float, int]:
    """The 16 streams, with 2K prompts arriving for `long_for` seconds (0: none): their
    result, wall seconds, and the long prompts answered."""
    body = {"model": "bench", "prompt": "x" * 15, "max_tokens": 128}
    run = pool.submit(run_clients, server.endpoint, body, 16, 2)
    long = pool.submit(long_prompts, server.endpoint, long_for) if long_for else None
    wall, records = run.result()
    return summarize(16, wall, records), wall, long.result() if long else 0


def one_round(pool: ProcessPoolExecutor, servers: dict[str, Server]) -> Round:
    requests = questions(128)
    results = []
    for name in ("cache", "plain"):
        wall, records = pool.submit(run_clients, servers[name].endpoint, requests, 32, 4).result()
        results.append(summarize(32, wall, records))
    cached, uncached = results
    alone, wall, _ = streams(pool, servers["chunked"], 0)
    # The long prompts keep coming for as long as the streams took alone.
    chunked, _, n_chunked = streams(pool, servers["chunked"], wall)
    unchunked, _, n_unchunked = streams(pool, servers["unchunked"], wall)
    return Round(cached, uncached, alone, chunked, unchunked, n_chunked, n_unchunked)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = bench_model()
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    load = os.getloadavg()[0]
    servers = {
        "cache": start(model, prefix_caching=True),
        "plain": start(model, prefix_caching=False),
        "chunked": start(model, prefix_caching=False, chunked_prefill=True),
        "unchunked": start(model, prefix_caching=False, chunked_prefill=False),
    }
    for server in servers.values():  # warm-up (first forwards, allocator), not measured
        pool.submit(run_clients, server.endpoint, questions(4), 4, 1).result()
    rounds = [one_round(pool, servers) for _ in range(args.rounds)]
    for server in servers.values():
        server.stop()
    pool.shutdown()
    print(
        f"# serving features bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; load "
        f"average {load:.1f} at the start"
    )
    ttft, itl = [], []
    for number, r in enumerate(rounds, 1):
        print(f"\nRound {number} (load average {os.getloadavg()[0]:.1f} at the end):\n")
        print("| run | clients | requests | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
        print("|---|---|---|---|---|---|")
        rows = [
            ("512-token system prompt, prefix cache on", r.cache_on),
            ("512-token system prompt, prefix cache off", r.cache_off),
            ("16 streams alone", r.alone),
            (f"16 streams + {r.long_chunked} x 2K prompts, chunked prefill", r.chunked),
            (f"16 streams + {r.long_unchunked} x 2K prompts, no chunking", r.unchunked),
        ]
        for name, x in rows:
            print(
                f"| {name} | {x.clients} | {x.requests} | {x.tokens_per_s:,.0f} | "
                f"{x.ttft_p50:.3f} / {x.ttft_p99:.3f} | "
                f"{1000 * x.itl_p50:.1f} / {1000 * x.itl_p99:.1f} |"
            )
        ttft.append(r.cache_off.ttft_p50 / r.cache_on.ttft_p50)
        itl.append((r.chunked.itl_p99 / r.alone.itl_p99, r.unchunked.itl_p99 / r.alone.itl_p99))
        print(
            f"\nPrefix cache: TTFT p50 {ttft[-1]:.1f}x lower, tokens/s "
            f"{r.cache_on.tokens_per_s / r.cache_off.tokens_per_s:.1f}x. Streams' ITL p99 "
            f"against no arrival: {itl[-1][0]:.1f}x with chunked prefill, {itl[-1][1]:.1f}x "
            "without."
        )
    if len(rounds) > 1:
        print(
            f"\nMedians over {len(rounds)} rounds: TTFT p50 {statistics.median(ttft):.1f}x lower "
            f"with the cache; ITL p99 {statistics.median(a for a, _ in itl):.1f}x (chunked) and "
            f"{statistics.median(b for _, b in itl):.1f}x (not) the no-arrival value."
        )


if __name__ == "__main__":
    main()
