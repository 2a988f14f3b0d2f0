"""Grouped GEMM benchmark: the MoE expert matmul three ways, side by side in one run.

    PYTHONPATH=. python3 kernels/bench/grouped_gemm_bench.py            # the GPU if there is one
    PYTHONPATH=. python3 kernels/bench/grouped_gemm_bench.py --device cpu

Rows sorted by expert (tokens x top-k of them), E experts of (K, N): forward + backward of
  kernels  `kernels.grouped_gemm`: one Triton launch over every group's tiles (on a GPU; on a
           CPU without the interpreter it is the reference below)
  loop     `kernels.reference.grouped_gemm`: one matmul per expert
  padded   every group padded to the largest and one batched matmul (what a capacity factor
           of max/mean buys: no host loop, but compute on padding)
for an even split and a skewed one (Zipf over experts, as a router early in training gives).
Writes grouped_gemm_<device>.md (device, versions, date) next to this file.
"""

import argparse
import datetime
import platform
from pathlib import Path

import torch

import kernels
from kernels import reference
from kernels.bench import measure


def split(rows: int, experts: int, skew: float) -> list[int]:
    """Group sizes summing to `rows`: even for skew 0, Zipf(skew) over experts otherwise."""
    weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -skew
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[0] += rows - int(sizes.sum())
    return sizes.tolist()


def padded(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    longest = max(sizes)
    batch = x.new_zeros(len(sizes), longest, x.shape[1])
    for g, rows in enumerate(torch.split(x, sizes)):
        batch[g, : len(rows)] = rows
    out = torch.bmm(batch, w)
    return torch.cat([out[g, :n] for g, n in enumerate(sizes)])


IMPLS = {"kernels": kernels.grouped_gemm, "loop": reference.grouped_gemm, "padded": padded}


def run(device, dtype, impls: dict, rows: int, experts: int, K: int, N: int) -> list[str]:
    lines = []
    base = next(iter(impls))
    for skew in (0.0, 1.2):
        sizes = split(rows, experts, skew)
        torch.manual_seed(0)
        x = torch.randn(rows, K, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(experts, K, N, device=device, dtype=dtype) / K**0.5
        w.requires_grad_(True)

        def step(fn, x=x, w=w, sizes=sizes):
            return lambda: fn(x, w, sizes).sum().backward()

        ms = measure.time_ms({n: step(f) for n, f in impls.items()}, device, reps=5, warmup=2)
        useful = 6.0 * rows * K * N  # forward + backward FLOPs of the real rows
        imbalance = max(sizes) / (rows / experts)
        lines.append(
            f"| {rows} x {K} -> {N}, {experts} experts, max/mean {imbalance:.2f} | "
            + " | ".join(f"{ms[n]:.2f} ms ({useful / ms[n] / 1e6:.1f} GFLOP/s)" for n in impls)
            + " | "
            + " | ".join(f"{ms[n] / ms[base]:.2f}x" for n in impls if n != base)
            + " |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = p.parse_args()
    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    name = torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu"
    shapes = [(8192, 8, 1024, 2816), (16384, 64, 1024, 512)] if on_gpu else [(2048, 8, 128, 192)]
    # Off a GPU `kernels` is the loop itself: timing it twice would only measure noise.
    impls = IMPLS if on_gpu else {n: f for n, f in IMPLS.items() if n != "kernels"}
    base = next(iter(impls))
    others = [n for n in impls if n != base]
    header = [
        f"# Grouped GEMM, forward + backward, {device.type} ({name}), {dtype}",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, threads {torch.get_num_threads()}"
        + ("" if on_gpu else "; no Triton on a CPU: the loop and padding only"),
        "",
        "| shape | "
        + " | ".join(impls)
        + " | "
        + " | ".join(f"{n} / {base}" for n in others)
        + " |",
        "|---" * (1 + len(impls) + len(others)) + "|",
    ]
    body = [line for shape in shapes for line in run(device, dtype, impls, *shape)]
    text = "\n".join(header + body) + "\n"
    print(text)
    (a.out / f"grouped_gemm_{device.type}.md").write_text(text)


if __name__ == "__main__":
    main()
