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
from collections.abc import Callable
from pathlib import Path

import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer import model_setup
from trainer.data.loader import PackedRowLoader
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.lm_loss import summed_loss
from trainer.model import attention_layout
from trainer.recipes.lm import lm_trainer


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


def copy(cfg):
    out = type(cfg)()
    out.CopyFrom(cfg)
    return out


def new_trainer(cfg, ds, env, run_dir):
    vocab = ds.tokenizer.vocab_size
    return lm_trainer(cfg, run_dir, env, ds.path, vocab, log=quiet)


class HandLoop:
    """The plainest loop that trains the same model on the same batches."""

    def __init__(self, cfg, ds, env):
        self.model = model_setup.build_model(cfg, ds.tokenizer.vocab_size, env.device)
        o = cfg.optim
        self.clip = o.grad_clip
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2)
        )
        self.loader = PackedRowLoader(
            ds.path, batch_size=cfg.train.micro_batch, seed=cfg.train.seed
        )
        self.device = env.device

    def advance(self) -> None:
        b = next(self.loader)
        layout = attention_layout(b["document_ids"], self.device, torch.float32)
        loss = summed_loss(self.model, b["input_ids"], b["position_ids"], layout, b["labels"])
        (loss / (b["labels"] != -100).sum()).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def instrument(trainer) -> Clock:
    """A Clock of the time the Trainer spends reporting: step stats, goodput, log records."""
    reporting = Clock()
    # The outermost reporting calls of a step (nested ones would count twice).
    trainer.metrics.step = reporting.wrap(trainer.metrics.step)
    trainer.goodput.add = reporting.wrap(trainer.goodput.add)
    trainer._log_step = reporting.wrap(trainer._log_step)
    return reporting


def cpu_bench(cfg, ds, warmup: int, steps: int) -> list[str]:
    """Steps of the hand loop and of two Trainers (logging every 10 steps and every step)
    interleaved one by one, in rotating order: a machine whose load changes from minute to
    minute slows all three alike, so their ratios hold even when absolute speeds do not."""
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    Side = str | int  # "hand", or a Trainer's log_every
    times: dict[Side, list[float]] = {"hand": [], 10: [], 1: []}
    reporting: dict[Side, Clock] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        sides: dict[Side, Callable[[], object]] = {"hand": HandLoop(cfg, ds, env).advance}
        for every in (10, 1):
            run = copy(cfg)
            run.train.steps, run.train.log_every = 10**9, every
            trainer = new_trainer(run, ds, env, Path(run_dir) / str(every))
            reporting[every] = instrument(trainer)
            sides[every] = trainer.advance
        order = list(sides)
        for i in range(warmup + steps):
            if i == warmup:
                for clock in reporting.values():
                    clock.seconds = 0.0
            for side in order[i % 3 :] + order[: i % 3]:
                start = time.perf_counter()
                sides[side]()
                if i >= warmup:
                    times[side].append(time.perf_counter() - start)
    hand = statistics.median(times["hand"])
    m = cfg.model
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"Model: the default tiny config ({m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, "
        f"seq {cfg.data.seq_len}, micro-batch {cfg.train.micro_batch}, fp32) on the precooked "
        f"standard library. {steps} timed steps of each side after {warmup} warm-up steps, "
        "interleaved one step at a time in rotating order. Load average at the end "
        f"(1, 5, 15 min): {load} on {os.cpu_count()} CPUs: other jobs shared the machine, so "
        "absolute step times are slower than on an idle one; the ratios are what to read.",
        "",
        "| side | median step | mean step | steps/s (median) | vs hand loop (goal >= 0.97) "
        "| metrics reporting, % of step time (goal < 1%) |",
        "|---|---|---|---|---|---|",
    ]
    labels: tuple[tuple[Side, str], ...] = (
        ("hand", "hand-written loop"),
        (10, "Trainer, log every 10"),
        (1, "Trainer, log every step"),
    )
    for side, label in labels:
        median, mean = statistics.median(times[side]), statistics.fmean(times[side])
        share = (
            f"{100 * reporting[side].seconds / sum(times[side]):.3f}%" if side != "hand" else "-"
        )
        ratio = f"{hand / median:.3f}" if side != "hand" else "1"
        lines.append(
            f"| {label} | {median * 1e3:,.1f} ms | {mean * 1e3:,.1f} ms | {1 / median:.3f} "
            f"| {ratio} | {share} |"
        )
    return lines


def gpu_bench(args, cache_dir: str) -> list[str]:
    """MFU of a ~1B model (16 x 2048, GQA 16/8, cl100k vocabulary, untied head) per setting.
    `--gpu-model tiny` runs the same rows with a small model, on the CPU when there is no GPU:
    the plumbing of tools/gpu/verify.sh --tiny, not a measurement."""
    cuda = torch.cuda.is_available()
    env = DistEnv(0, 1, 0, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    lines = [
        f"GPU: {torch.cuda.get_device_name(0) if cuda else 'none, CPU'}, torch {torch.__version__}",
        "",
        "| seq | kernels | compile | params | tokens/step | MFU (basis) | TFLOP/s | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seq in args.seq:
        cfg = trainer_config_pb2.TrainerConfig()
        cfg.data.seq_len = seq
        m = cfg.model
        if args.gpu_model == "1b":
            cfg.data.tokenizer = trainer_config_pb2.CL100K
            m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 2048, 16, 16, 8, 5632
            m.tie_embeddings = False
        else:
            cfg.data.max_documents = 50
            m.dim, m.n_layers, m.n_heads = 64, 2, 4
        cfg.train.micro_batch = max(1, args.tokens_per_step // seq)
        cfg.train.steps = args.gpu_warmup + args.gpu_steps
        cfg.train.log_every, cfg.train.eval_every = 1, 0
        cfg.checkpoint.every_steps = 0
        base = resolve_trainer(cfg)
        ds = precook_dataset(base.data, cache_dir, show_progress=True)
        for kernels_on in args.kernels:
            for compiled in args.compile:
                run = copy(base)
                run.model.use_kernels, run.train.compile = kernels_on, compiled
                lines.append(gpu_row(run, ds, env, args.gpu_warmup))
                print(lines[-1], file=sys.stderr)
    return lines


def gpu_row(cfg, ds, env, warmup: int) -> str:
    """Steps driven one by one (no final checkpoint of a 1B model to wait for), logged each
    step; the median over the steps after the warm-up (which includes compilation)."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = new_trainer(cfg, ds, env, run_dir)
        records: list = []
        trainer.metrics.sinks.append(records.append)
        while trainer.step < cfg.train.steps:
            trainer.advance()
        params = sum(p.numel() for p in trainer.model.parameters())
        del trainer
        torch.cuda.empty_cache()
    timed = [p for p in records if p.phase == "train"][warmup:]
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
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", help="also write the Markdown report here")
    p.add_argument("--seq", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    p.add_argument("--kernels", type=on_off, default=[True, False])
    p.add_argument("--compile", type=on_off, default=[False, True])
    p.add_argument("--tokens-per-step", type=int, default=32768)
    p.add_argument("--gpu-warmup", type=int, default=3)
    p.add_argument("--gpu-steps", type=int, default=10)
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--gpu-model", choices=("1b", "tiny"), default="1b", help="tiny: CPU plumbing")
    args = p.parse_args()

    lines = [
        "# Trainer benchmark",
        "",
        f"{datetime.date.today().isoformat()}, {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs), torch threads: {torch.get_num_threads()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"Command: `{' '.join(sys.argv)}`",
        "",
    ]
    if not args.skip_cpu:
        cfg = resolve_trainer(trainer_config_pb2.TrainerConfig())  # the default tiny model
        cfg.train.eval_every = cfg.checkpoint.every_steps = 0
        ds = precook_dataset(cfg.data, args.cache_dir, show_progress=True)
        lines += ["## CPU: framework overhead", ""]
        lines += cpu_bench(cfg, ds, args.warmup, args.steps)
        lines.append("")
    lines.append("## GPU: MFU of a ~1B model on packed rows")
    lines.append("")
    if torch.cuda.is_available() or args.gpu_model == "tiny":
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
