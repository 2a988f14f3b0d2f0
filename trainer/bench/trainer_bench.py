"""Trainer benchmark: what the framework costs, and the MFU it reaches.

CPU (always): steps/s of the real Trainer against a minimal hand-written loop of the same
model on the same batches, measured side by side in alternating rounds (goal: ratio >= 0.97),
and the share of step time spent reporting metrics (goal: < 1%).

GPU (when CUDA is present): MFU of a ~1B-parameter model on packed rows at sequence 4K and 8K,
fused kernels on and off, torch.compile on and off, as the trainer itself reports it.

    python trainer/bench/trainer_bench.py [--out trainer/bench/trainer_bench_cpu.md]
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from protos import trainer_config_pb2
from trainer import config, loop
from trainer.data.loader import PackedRowLoader
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.model import attention_layout


def quiet(_message: str) -> None:
    pass


class Clock:
    """Wall time spent inside the wrapped callables."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def trainer_round(cfg, ds, env, warmup: int, steps: int, log_every: int) -> dict:
    """Steps/s of the real Trainer between its log lines at `warmup` and `warmup + steps`,
    and the time spent reporting metrics in between."""
    cfg = copy(cfg)
    cfg.train.steps = warmup + steps
    cfg.train.log_every = log_every
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = new_trainer(cfg, ds, env, run_dir)
        stamps, reporting = {}, Clock()
        trainer.metrics.sinks.append(lambda p: stamps.setdefault(p.step, time.perf_counter()))
        m = trainer.metrics
        m.step, m.emit, m.human_line = map(reporting.wrap, (m.step, m.emit, m.human_line))
        trainer.goodput.add = reporting.wrap(trainer.goodput.add)
        trainer.log = reporting.wrap(trainer.log)
        real_peak = loop.peak_memory_bytes
        loop.peak_memory_bytes = reporting.wrap(real_peak)
        try:
            trainer.run()
        finally:
            loop.peak_memory_bytes = real_peak
        # From the first log line after the warm-up to the last one (log lines come every
        # `log_every` steps, and at the final step).
        first, last = warmup, warmup + steps
        # Reporting runs between steps, outside their timing: its share of all step time.
        stepping = trainer.goodput.seconds["productive"] + trainer.goodput.seconds["data"]
        steps_per_s = (last - first) / (stamps[last] - stamps[first])
        return {"steps_per_s": steps_per_s, "reporting_share": reporting.seconds / stepping}


def copy(cfg):
    out = type(cfg)()
    out.CopyFrom(cfg)
    return out


def new_trainer(cfg, ds, env, run_dir):
    vocab = ds.tokenizer.vocab_size
    return loop.Trainer(cfg, "PRETRAIN", run_dir, env, ds.path, vocab, log=quiet)


def hand_round(cfg, ds, env, warmup: int, steps: int) -> float:
    """Steps/s of the plainest loop that trains the same model on the same batches."""
    model = loop.build_model(cfg, ds.tokenizer.vocab_size, env.device)
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2))
    loader = PackedRowLoader(ds.path, batch_size=cfg.train.micro_batch, seed=cfg.train.seed)
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        b = next(loader)
        layout = attention_layout(b["document_ids"], env.device, torch.float32)
        loss = model(b["input_ids"], b["position_ids"], layout, b["labels"])
        (loss / (b["labels"] != -100).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps / (time.perf_counter() - start)


def cpu_bench(cfg, ds, rounds: int, warmup: int, steps: int) -> list[str]:
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ratios, hand, framework, shares = [], [], [], {}
    for r in range(rounds):
        # Alternate which goes first, so a machine that speeds up or slows down mid-run
        # does not favour one side.
        order = ("hand", "trainer") if r % 2 == 0 else ("trainer", "hand")
        result = {}
        for side in order:
            if side == "hand":
                result["hand"] = hand_round(cfg, ds, env, warmup, steps)
            else:
                t = trainer_round(cfg, ds, env, warmup, steps, cfg.train.log_every)
                result["trainer"] = t["steps_per_s"]
                shares.setdefault(cfg.train.log_every, []).append(t["reporting_share"])
        hand.append(result["hand"])
        framework.append(result["trainer"])
        ratios.append(result["trainer"] / result["hand"])
        print(
            f"round {r + 1}/{rounds}: trainer {result['trainer']:.3f} steps/s, hand loop "
            f"{result['hand']:.3f} steps/s, ratio {ratios[-1]:.3f}",
            file=sys.stderr,
        )
    worst = trainer_round(cfg, ds, env, warmup, steps, 1)
    shares.setdefault(1, []).append(worst["reporting_share"])
    m = cfg.model
    lines = [
        f"Model: {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, seq {cfg.data.seq_len}, "
        f"micro-batch {cfg.train.micro_batch}, fp32; {rounds} alternating rounds of {steps} "
        f"timed steps after {warmup} warm-up steps.",
        "",
        "| measure | median | min | max |",
        "|---|---|---|---|",
        _row("hand-written loop, steps/s", hand),
        _row("Trainer, steps/s", framework),
        _row("Trainer / hand loop (goal >= 0.97)", ratios),
    ]
    for every, values in sorted(shares.items()):
        name = f"metrics reporting, % of step time, log every {every} (goal < 1%)"
        lines.append(_row(name, [100 * v for v in values]))
    return lines


def _row(name: str, values: list[float]) -> str:
    return f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |"


def gpu_bench(args, cache_dir: str) -> list[str]:
    """MFU of a ~1B model (16 x 2048, GQA 16/8, cl100k vocabulary, untied head) per setting."""
    env = DistEnv(0, 1, 0, torch.device("cuda", 0))
    lines = [
        f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "",
        "| seq | kernels | compile | params | tokens/step | MFU (basis) | TFLOP/s | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seq in args.seq:
        cfg = trainer_config_pb2.TrainerConfig()
        cfg.data.tokenizer = trainer_config_pb2.CL100K
        cfg.data.seq_len = seq
        m = cfg.model
        m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 2048, 16, 16, 8, 5632
        m.tie_embeddings = False
        cfg.train.micro_batch = max(1, args.tokens_per_step // seq)
        cfg.train.steps = args.gpu_warmup + args.gpu_steps
        cfg.train.log_every, cfg.train.eval_every = 1, 0
        cfg.checkpoint.every_steps = 0
        base = config.resolve(cfg)
        ds = precook_dataset(base.data, cache_dir, show_progress=True)
        for kernels_on in args.kernels:
            for compiled in args.compile:
                run = copy(base)
                run.model.use_kernels, run.train.compile = kernels_on, compiled
                lines.append(gpu_row(run, ds, env, args.gpu_warmup))
                print(lines[-1], file=sys.stderr)
    return lines


def gpu_row(cfg, ds, env, warmup: int) -> str:
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = new_trainer(cfg, ds, env, run_dir)
        records = []
        trainer.metrics.sinks.append(records.append)
        trainer.run()
        params = sum(p.numel() for p in trainer.model.parameters())
    timed = [p for p in records if p.phase == "train" and p.tokens_per_second][warmup:]
    mfu = statistics.median(p.mfu for p in timed)
    return (
        f"| {cfg.data.seq_len} | {'on' if cfg.model.use_kernels else 'off'} | "
        f"{'on' if cfg.train.compile else 'off'} | {params / 1e9:.2f} B | "
        f"{cfg.train.micro_batch * cfg.data.seq_len:,} | {mfu:.1%} ({timed[0].mfu_basis}) | "
        f"{statistics.median(p.tflops for p in timed):.0f} | "
        f"{statistics.median(p.tokens_per_second for p in timed):,.0f} |"
    )


def on_off(text: str) -> list[bool]:
    return [v.strip() == "on" for v in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", default=".state/precook", help="precooked datasets")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", help="also write the Markdown report here")
    p.add_argument("--seq", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    p.add_argument("--kernels", type=on_off, default=[True, False])
    p.add_argument("--compile", type=on_off, default=[False, True])
    p.add_argument("--tokens-per-step", type=int, default=32768)
    p.add_argument("--gpu-warmup", type=int, default=3)
    p.add_argument("--gpu-steps", type=int, default=10)
    p.add_argument("--skip-cpu", action="store_true")
    args = p.parse_args()

    lines = [
        "# Trainer benchmark",
        "",
        f"{datetime.date.today().isoformat()}, {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs), {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"Command: `{' '.join(sys.argv)}`",
        "",
    ]
    if not args.skip_cpu:
        if args.warmup % 10 or args.steps % 10:
            p.error("--warmup and --steps must be multiples of 10 (the Trainer logs every 10)")
        cfg = config.resolve(trainer_config_pb2.TrainerConfig())  # the default tiny model
        cfg.train.eval_every = cfg.checkpoint.every_steps = 0
        ds = precook_dataset(cfg.data, args.cache_dir, show_progress=True)
        lines += ["## CPU: framework overhead", ""]
        lines += cpu_bench(cfg, ds, args.rounds, args.warmup, args.steps)
        lines.append("")
    lines.append("## GPU: MFU of a ~1B model on packed rows")
    lines.append("")
    if torch.cuda.is_available():
        lines += gpu_bench(args, args.cache_dir)
    else:
        lines.append("No CUDA device here: not measured.")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
