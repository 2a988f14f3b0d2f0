"""Kernel benchmark: every op against PyTorch eager and torch.compile, side by side in one run.

    PYTHONPATH=. python3 kernels/bench/bench_kernels.py            # the GPU if there is one
    PYTHONPATH=. python3 kernels/bench/bench_kernels.py --device cpu

For each op and size it measures forward, backward and forward+backward time (median) and the
peak memory of forward+backward above the inputs, for three implementations:
  kernels  `kernels.<op>`: compiled Triton on a GPU
  eager    `kernels.reference.<op>`: the plain PyTorch a model would write
  compile  `torch.compile(kernels.reference.<op>)`
It prints the kernels' ratios to both, checks the GPU goals of issue 5, and writes
results_<device>.csv and .md (device name, versions, date) next to this file (or to --out).

On CPU without TRITON_INTERPRET, `kernels.<op>` dispatches to `kernels.reference`, so the CPU
table measures that dispatch overhead and what torch.compile gains, not Triton: the Triton
numbers need a GPU. (The Triton interpreter is a correctness tool and is refused here.)
"""

import argparse
import csv
import datetime
import io
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels import reference
from kernels.bench import measure

OPS = ("rms_norm", "swiglu", "apply_rope", "cross_entropy", "fused_linear_cross_entropy")
IMPLS = ("kernels", "eager", "compile")


@dataclass(frozen=True)
class Sweep:
    dtype: torch.dtype
    tokens: tuple[int, ...]
    hidden: int
    intermediate: int  # SwiGLU width
    heads: int
    kv_heads: int
    head_dim: int
    vocabs: tuple[int, ...]
    reps: int
    warmup: int


# Issue 5's sweep, at Llama-3-8B's shapes (hidden 4096, SwiGLU 14336, 32 q / 8 kv heads of 128).
GPU_SWEEP = Sweep(torch.bfloat16, (2048, 4096, 8192, 16384), 4096, 14336, 32, 8, 128,
                  (32768, 131072), reps=20, warmup=5)  # fmt: skip
# Small enough for a shared 2-core machine; fp32 because CPU bf16 is emulated there.
CPU_SWEEP = Sweep(torch.float32, (256, 1024), 256, 768, 4, 2, 64, (8192,), reps=10, warmup=2)


@dataclass
class Case:
    op: str
    size: str  # for people: "tokens=2048 vocab=32768"
    args: tuple  # positional arguments of the op
    leaves: tuple[torch.Tensor, ...]  # the inputs that get gradients


@dataclass
class Spec:
    """One (op, size) of a sweep; `build` makes its inputs, so only one case is resident."""

    op: str
    tokens: int
    vocab: int | None
    sweep: Sweep
    device: torch.device

    @property
    def size(self) -> str:
        return f"tokens={self.tokens}" + (f" vocab={self.vocab}" if self.vocab else "")

    def build(self) -> Case:
        s, n, dev = self.sweep, self.tokens, self.device

        def leaf(*shape, scale=1.0):
            return (torch.randn(shape, device=dev) * scale).to(s.dtype).requires_grad_()

        if self.op == "rms_norm":
            x, w = leaf(n, s.hidden), leaf(s.hidden)
            return Case(self.op, self.size, (x, w), (x, w))
        if self.op == "swiglu":
            gate, up = leaf(n, s.intermediate), leaf(n, s.intermediate)
            return Case(self.op, self.size, (gate, up), (gate, up))
        if self.op == "apply_rope":
            q, k = leaf(1, n, s.heads, s.head_dim), leaf(1, n, s.kv_heads, s.head_dim)
            angles = torch.rand(1, n, s.head_dim, device=dev) * 6.3
            return Case(self.op, self.size, (q, k, angles.cos(), angles.sin()), (q, k))
        target = torch.randint(0, self.vocab, (n,), device=dev)
        target[::10] = -100  # some positions without a target, as in packed rows
        if self.op == "cross_entropy":
            logits = leaf(n, self.vocab)
            return Case(self.op, self.size, (logits, target), (logits,))
        hidden, weight = leaf(n, s.hidden), leaf(self.vocab, s.hidden, scale=s.hidden**-0.5)
        return Case(self.op, self.size, (hidden, weight, target), (hidden, weight))


def specs(sweep: Sweep, device: torch.device, ops: list[str]) -> list[Spec]:
    out = []
    for n in sweep.tokens:
        out += [Spec(op, n, None, sweep, device) for op in OPS[:3]]
        out += [Spec(op, n, v, sweep, device) for v in sweep.vocabs for op in OPS[3:]]
    return [s for s in out if s.op in ops]


def implementations(op: str) -> dict:
    return {
        "kernels": getattr(kernels, op),
        "eager": getattr(reference, op),
        "compile": torch.compile(getattr(reference, op)),
    }


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def measure_case(case: Case, fns: dict, sweep: Sweep, device: torch.device) -> dict:
    """{impl: {fwd_ms, bwd_ms, fwd_bwd_ms, peak_mib}} for one case, implementations interleaved."""
    first = next(iter(fns.values()))
    grads_out = tuple(torch.randn_like(o) for o in _outputs(first(*case.args)))

    def forward(fn):
        return lambda: _outputs(fn(*case.args))

    def backward(outputs):
        # A fresh graph each time: compiled backwards free ("donate") their buffers.
        torch.autograd.grad(outputs, case.leaves, grads_out)

    def forward_backward(fn):
        return lambda: backward(forward(fn)())

    reps, warmup = sweep.reps, sweep.warmup
    timings = {
        "fwd_ms": measure.time_ms({i: forward(fn) for i, fn in fns.items()}, device, reps, warmup),
        "bwd_ms": measure.time_ms(
            {i: backward for i in fns},
            device,
            reps,
            warmup,
            prepare={i: forward(fn) for i, fn in fns.items()},
        ),
        "fwd_bwd_ms": measure.time_ms(
            {i: forward_backward(fn) for i, fn in fns.items()}, device, reps, warmup
        ),
    }
    results = {}
    for impl, fn in fns.items():
        results[impl] = {metric: timings[metric][impl] for metric in timings}
        results[impl]["peak_mib"] = measure.peak_bytes(forward_backward(fn), device) / 2**20
    return results


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {threads} torch thread{'s' * (threads != 1)}, "
        f"load average {load} at start"
    )


def versions() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return f"python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}"


def run(sweep: Sweep, device: torch.device, ops: list[str], impls: list[str]) -> list[dict]:
    todo = specs(sweep, device, ops)
    fns = {op: implementations(op) for op in ops}
    rows = []
    for i, spec in enumerate(todo, start=1):
        print(f"[{i:>2}/{len(todo)}] {spec.op:<27} {spec.size}", file=sys.stderr, flush=True)
        case = spec.build()
        chosen = {impl: fns[spec.op][impl] for impl in impls}
        for impl, metrics in measure_case(case, chosen, sweep, device).items():
            rows.append({"op": spec.op, "size": spec.size, "impl": impl} | metrics)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds, on each kernels row, eager/kernels and compile/kernels time (>1 = kernels faster)
    and kernels/eager peak memory (<1 = kernels smaller)."""
    by_key = {(r["op"], r["size"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] != "kernels":
            continue
        for base in ("eager", "compile"):
            other = by_key.get((r["op"], r["size"], base))
            if other:
                r[f"speedup_vs_{base}"] = other["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        eager = by_key.get((r["op"], r["size"], "eager"))
        if eager and eager["peak_mib"] > 0:
            r["memory_vs_eager"] = r["peak_mib"] / eager["peak_mib"]
    return rows


def goals(rows: list[dict]) -> list[str]:
    """Issue 5's GPU goals, one line each, judged on the measured rows."""
    lines = []
    for r in rows:
        if r["impl"] != "kernels" or "speedup_vs_eager" not in r:
            continue
        ok = r["speedup_vs_eager"] >= 1 and r.get("speedup_vs_compile", 1) >= 1
        lines.append(
            f"{'met ' if ok else 'MISS'} {r['op']} {r['size']}: fwd+bwd at or below eager "
            f"({r['speedup_vs_eager']:.2f}x) and compile ({r.get('speedup_vs_compile', 0):.2f}x)"
        )
    for r in rows:
        if r["op"] == "fused_linear_cross_entropy" and r["impl"] == "kernels":
            if r["size"] == "tokens=8192 vocab=131072" and "memory_vs_eager" in r:
                ok = r["memory_vs_eager"] <= 0.25
                lines.append(
                    f"{'met ' if ok else 'MISS'} fused_linear_cross_entropy peak memory <= 1/4 of "
                    f"eager at 8K tokens, vocab 128K: {r['memory_vs_eager']:.3f}"
                )
    return lines


COLUMNS = ["op", "size", "impl", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "peak_mib",
           "speedup_vs_eager", "speedup_vs_compile", "memory_vs_eager"]  # fmt: skip


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict], header: list[str], goal_lines: list[str]) -> str:
    out = io.StringIO()
    out.write("# Kernel benchmark\n\n")
    out.writelines(f"- {line}\n" for line in header)
    out.write("\nTimes in ms (median); peak = MiB allocated by forward+backward above the inputs. ")
    out.write("speedup = other's fwd+bwd time / kernels' (>1: kernels faster); ")
    out.write("memory_vs_eager = kernels' peak / eager's (<1: kernels smaller).\n\n")
    out.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
    for r in rows:
        out.write("| " + " | ".join(_fmt(r.get(c, "")) for c in COLUMNS) + " |\n")
    if goal_lines:
        out.write("\n## Goals (issue 5, GPU)\n\n")
        out.writelines(f"- {line}\n" for line in goal_lines)
    return out.getvalue()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def csv_text(rows: list[dict], meta: dict) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS + list(meta))
    writer.writeheader()
    for r in rows:
        writer.writerow({c: _fmt(r.get(c, "")) for c in COLUMNS} | meta)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of ops")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    parser.add_argument("--out", type=Path, help="output prefix (default: results_<device>)")
    parser.add_argument("--tokens", help="comma-separated token counts replacing the sweep's")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for a CPU run (default 1: on a shared machine, OpenMP-parallel "
        "compiled kernels stall at barriers, e.g. 35 ms instead of 0.27 ms for one RMSNorm)",
    )
    args = parser.parse_args(argv)

    if kernels.dispatch.INTERPRET:
        parser.error("TRITON_INTERPRET=1 is set: interpreted kernels are for tests, not timing")
    want = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if want == "auto" else want)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    ops, impls = args.ops.split(","), args.impls.split(",")
    for flag, chosen, allowed in (("--ops", ops, OPS), ("--impls", impls, IMPLS)):
        if unknown := set(chosen) - set(allowed):
            parser.error(f"{flag}: unknown {sorted(unknown)}; choose from {', '.join(allowed)}")
    sweep = GPU_SWEEP if device.type == "cuda" else CPU_SWEEP
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.tokens:
        sweep = Sweep(**(vars(sweep) | {"tokens": tuple(int(t) for t in args.tokens.split(","))}))

    name = device_name(device)
    path = (
        "compiled Triton" if kernels.triton_available(device) else "kernels.reference (no Triton)"
    )
    header = [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"device: {name}",
        f"versions: {versions()}",
        f"dtype: {str(sweep.dtype).removeprefix('torch.')}; kernels path: {path}",
        f"command: {' '.join([Path(sys.argv[0]).name] + (argv or sys.argv[1:]))}",
    ]
    if device.type == "cpu":
        header.append(
            "CPU run: kernels.* dispatches to kernels.reference here, so 'kernels' vs 'eager' is "
            "the dispatch overhead and 'compile' is torch.compile of the reference; the Triton "
            "kernels themselves are only timed on a GPU (see kernels/bench/README.md)."
        )
    print(f"benchmarking {', '.join(ops)} on {name}", file=sys.stderr)

    rows = with_ratios(run(sweep, device, ops, impls))
    goal_lines = goals(rows) if device.type == "cuda" else []
    report = markdown(rows, header, goal_lines)
    print(report)
    prefix = args.out or _default_dir() / f"results_{device.type}"
    meta = {"device": name, "dtype": str(sweep.dtype), "versions": versions(),
            "date": header[0].removeprefix("date: ")}  # fmt: skip
    write_atomic(prefix.with_suffix(".md"), report)
    write_atomic(prefix.with_suffix(".csv"), csv_text(rows, meta))
    print(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.csv')}", file=sys.stderr)
    return 0


def _default_dir() -> Path:
    # Under `bazel run` the script sits in a read-only runfiles tree: write to the source tree.
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    return Path(workspace) / "kernels" / "bench" if workspace else Path(__file__).resolve().parent


if __name__ == "__main__":
    sys.exit(main())
