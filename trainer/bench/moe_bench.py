"""MoE capacity benchmark: what a capacity factor buys in time and costs in dropped tokens.

One MoE layer (the guide's: width 128, 8 experts of 192, top-2), forward + backward over 1,024
tokens whose router favours a few experts (as early in training, or collapsing), at capacity
factors dropless, 2, 1.25 and 1, timed side by side in interleaved rounds (median).

    PYTHONPATH=.:.gen python trainer/bench/moe_bench.py [--out trainer/bench/moe_bench_cpu.md]
"""

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from kernels import reference
from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer import moe

FACTORS = (0.0, 2.0, 1.25, 1.0)  # 0: dropless


def layer(capacity: float) -> moe.MoEFeedForward:
    cfg = trainer_config_pb2.TrainerConfig()
    m = cfg.model
    m.dim, m.n_heads, m.moe_experts, m.moe_top_k, m.moe_ffn_dim = 128, 4, 8, 2, 192
    m.moe_capacity_factor = capacity
    torch.manual_seed(0)
    out = moe.MoEFeedForward(resolve_trainer(cfg).model, reference, 0)
    for p in out.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():  # a skewed router: experts 0 and 1 preferred
        out.router.weight[:2] += 0.004
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("moe_bench_cpu.md"))
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    torch.manual_seed(1)
    x = torch.randn(8, 128, 128) + 0.5
    layers = {f: layer(f) for f in FACTORS}
    times: dict[float, list[float]] = {f: [] for f in FACTORS}
    for _ in range(a.rounds):
        for f, mod in layers.items():
            start = time.perf_counter()
            mod(x).sum().backward()
            times[f].append(time.perf_counter() - start)
    rows = []
    dropless = statistics.median(times[0.0])
    for f, mod in layers.items():
        moe.collect(mod)
        stats = moe.progress_fields(mod)
        ms = statistics.median(times[f]) * 1e3
        name = "dropless" if f == 0 else f"{f:g}"
        rows.append(
            f"| {name} | {ms:.1f} | {dropless * 1e3 / ms:.2f}x | "
            f"{stats['moe_dropped_fraction']:.1%} | {stats['moe_max_imbalance']:.2f} |"
        )
    text = "\n".join(
        [
            "# MoE layer: capacity factor vs time and dropped tokens",
            "",
            f"{datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}; median of {a.rounds} interleaved rounds",
            "",
            "| capacity factor | fwd+bwd ms | speed vs dropless | dropped | max/mean load |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(text)
    a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
