"""Where an engine step's time goes: one request at a time against 32 decoding together.

    python -m trainer.bench.serve_step_profile [--batch 32] [--max-tokens 64]

The engine alone (no HTTP), on serve_bench's model: first the time per generated token of each
side without a profiler, then each side under cProfile with the CPU time split into the parts
of a step. cProfile's own cost falls on Python calls, so the Python parts read high against the
tensor ops; the ratio line above them is the one without the profiler.
"""

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable

import torch

from protos import defaults, trainer_config_pb2
from trainer.bench.machine import cpu_ticks, stolen_share
from trainer.bench.serve_bench import VOCAB, bench_model
from trainer.inference.engine import Engine, Request, SamplingParams
from trainer.inference.kv_cache import PagedKVCache
from trainer.inference.paged_model import StepBatch
from trainer.inference.scheduler import Scheduler

# The parts of a step: functions whose cumulative time is counted (disjoint: none calls
# another), and the two tensor ops that do the arithmetic.
PARTS: dict[str, str | tuple[Callable[..., object], ...]] = {
    "matmuls (projections, MLP, output layer)": "<built-in method torch._C._nn.linear>",
    "attention (scaled_dot_product_attention)": (
        "<built-in method torch._C._nn.scaled_dot_product_attention>"
    ),
    "paged KV cache: write, gather whole blocks": (PagedKVCache.write, PagedKVCache.gather),
    "the step's index tensors (StepBatch)": (StepBatch.__init__,),
    "scheduling (token budget, blocks)": (Scheduler.schedule,),
    "sampling (one argmax / per request)": (Engine._sample,),
    "detokenize, stop strings, outputs": (Engine._append,),
}


def run(model, batch: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """CPU seconds and tokens for `requests` greedy requests, `batch` running at a time."""
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.serve.max_running, cfg.serve.max_batch_tokens = batch, 2048
    engine = Engine(
        model,
        defaults.with_defaults(cfg).serve,
        decode=lambda ids: "".join(chr(97 + i % 26) for i in ids),
        eos_id=VOCAB,
        max_len=128,
    )
    for i in range(requests):
        engine.add(Request(str(i), [1] + [120] * 15, SamplingParams(max_tokens, 0.0)))
    tokens, cpu = 0, time.thread_time()
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return time.thread_time() - cpu, tokens


def parts(stats: pstats.Stats) -> dict[str, float]:
    """CPU seconds of each part of PARTS in a profile."""
    times = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (.., tot, cum, ..)}
    found = {}
    for part, what in PARTS.items():
        if isinstance(what, str):
            keys = [("~", 0, what)]
        else:
            codes = [f.__code__ for f in what]
            keys = [(c.co_filename, c.co_firstlineno, c.co_name) for c in codes]
        found[part] = sum(times[k][3] for k in keys if k in times)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = bench_model()
    sides = {"one at a time": 1, f"{args.batch} together": args.batch}
    per_token = {}
    ticks = cpu_ticks()
    for name, batch in sides.items():
        run(model, batch, batch, args.max_tokens)  # warm-up
        cpu, tokens = run(model, batch, 4 * batch, args.max_tokens)
        per_token[name] = 1e6 * cpu / tokens
    one, many = per_token.values()
    print(
        f"engine alone, CPU per generated token: one at a time {one:.0f} us, {args.batch} "
        f"together {many:.0f} us ({one / many:.1f}x); load average {os.getloadavg()[0]:.1f}, "
        f"{100 * stolen_share(ticks, cpu_ticks()):.0f}% of the CPU time stolen by the hypervisor\n"
    )
    print("| part of the step (under cProfile) | " + " | ".join(sides) + " |")
    print("|---|" + "---|" * len(sides))
    rows: dict[str, list[str]] = {}
    for batch in sides.values():
        profile = cProfile.Profile(time.thread_time)
        profile.enable()
        cpu, tokens = run(model, batch, 4 * batch, args.max_tokens)
        profile.disable()
        found = parts(pstats.Stats(profile))
        for part in PARTS:
            rows.setdefault(part, []).append(f"{1e6 * found.get(part, 0.0) / tokens:.0f} us")
        rest = cpu - sum(found.values())
        rows.setdefault("the rest (norms, rope, MLP glue, module calls)", []).append(
            f"{1e6 * rest / tokens:.0f} us"
        )
        rows.setdefault("all, per generated token", []).append(f"{1e6 * cpu / tokens:.0f} us")
    for part, cells in rows.items():
        print(f"| {part} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
