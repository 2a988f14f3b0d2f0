"""Truncate or re-bucket, 4K or 8K: every packing strategy trained side by side, measured.

    PYTHONPATH=.:.gen python3 trainer/bench/packing_throughput_bench.py \
        --out trainer/bench/packing_throughput_cpu.md

For each sequence length T, the standard library is precooked with every strategy (pad =
truncate, bucket = re-bucket, concat, best_fit; one tokenized corpus, cached), and one model per
strategy (same initialization) trains on its own rows. Steps of the strategies are interleaved
one at a time in rotating order, so a machine whose load changes slows them alike. Each step
takes `--tokens-per-step` slots (rows = tokens / T; bucket rows are shorter). Reported per
(T, strategy), beside the waste `precook analyze` computes:

- useful tokens/s: tokens with a next-token target in their row (what the model learns from)
  per second of step time; and the ratio to best_fit at the same T, and of 8K to 4K.
- loss per token: the summed cross entropy / target tokens, mean over the timed steps. Over a
  few steps it mostly tells which tokens a strategy trains on (pad keeps only documents'
  beginnings), not which strategy learns better.

On CPU the model is tiny (attention over a dense document mask), so the absolute numbers are
this machine's; on a GPU pass --dim/--layers for a real model (varlen attention in bf16).
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch

from protos import trainer_config_pb2 as pb
from protos.validation import resolve_trainer
from trainer import model_setup
from trainer.bench.machine import machine
from trainer.data.loader import IGNORE, PackedRowLoader
from trainer.data.packing import STRATEGIES
from trainer.data.precook import PrecookedDataset, precook_dataset
from trainer.lm_loss import summed_loss
from trainer.model import attention_layout


class Side:
    """One strategy at one T: its dataset, model, optimizer, loader and measurements."""

    def __init__(self, cfg: pb.TrainerConfig, ds: PrecookedDataset, device: torch.device):
        self.ds, self.device = ds, device
        self.model = model_setup.build_model(cfg, ds.tokenizer.vocab_size, device)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr)
        self.loader = PackedRowLoader(ds.path, batch_size=cfg.train.micro_batch, seed=1)
        self.seconds: list[float] = []
        self.useful: list[int] = []
        self.slots: list[int] = []
        self.loss: list[float] = []

    def step(self, timed: bool) -> None:
        b = next(self.loader)
        start = time.perf_counter()
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        layout = attention_layout(b["document_ids"], self.device, dtype)
        labels = b["labels"].to(self.device)
        n = int((labels != IGNORE).sum())
        with torch.autocast(self.device.type, dtype, enabled=self.device.type == "cuda"):
            loss = summed_loss(
                self.model,
                b["input_ids"].to(self.device),
                b["position_ids"].to(self.device),
                layout,
                labels,
            )
        (loss / max(n, 1)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())  # waits for the device
        if timed:
            self.seconds.append(time.perf_counter() - start)
            self.useful.append(n)
            self.slots.append(b["labels"].numel())
            self.loss.append(value / max(n, 1))


def config(args, seq_len: int, strategy: str) -> pb.TrainerConfig:
    cfg = pb.TrainerConfig()
    cfg.data.seq_len = seq_len
    cfg.data.packing = getattr(pb, strategy.upper())  # the Packing value of that name
    cfg.data.workers = os.cpu_count() or 1
    m = cfg.model
    m.dim, m.n_layers, m.n_heads = args.dim, args.layers, args.heads
    cfg.train.micro_batch = max(1, args.tokens_per_step // seq_len)
    return resolve_trainer(cfg)


def bench(args, cache: str) -> list[str]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    results: dict[tuple[int, str], dict] = {}
    for seq_len in args.seq:
        sides = {}
        for strategy in STRATEGIES:
            cfg = config(args, seq_len, strategy)
            ds = precook_dataset(cfg.data, cache, show_progress=False)
            sides[strategy] = Side(cfg, ds, device)
        order = list(sides)
        for i in range(args.warmup + args.steps):
            for s in order[i % len(order) :] + order[: i % len(order)]:
                sides[s].step(timed=i >= args.warmup)
            print(f"T={seq_len} step {i + 1}/{args.warmup + args.steps}", file=sys.stderr)
        for strategy, side in sides.items():
            train = side.ds.manifest.splits["train"]
            results[(seq_len, strategy)] = {
                "useful_per_s": sum(side.useful) / sum(side.seconds),
                "slots_per_s": sum(side.slots) / sum(side.seconds),
                "useful_share": sum(side.useful) / sum(side.slots),
                "step_ms": 1e3 * statistics.median(side.seconds),
                "loss": statistics.fmean(side.loss),
                "padding_pct": 100 * train.padding_tokens / max(train.slots, 1),
                "truncated_pct": 100 * train.truncated_tokens / max(train.tokens, 1),
                "efficiency_pct": 100 * train.target_tokens / max(train.slots, 1),
            }
    rows += [
        "| T | strategy | computed: padding (%) | computed: truncated (%) | computed: "
        "efficiency (%) | measured: useful share of batch (%) | median step | useful tokens/s "
        f"| vs best_fit at T | vs same strategy at {min(args.seq)} | loss / token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (seq_len, strategy), r in results.items():
        best = results[(seq_len, "best_fit")]["useful_per_s"]
        short = results.get((min(args.seq), strategy), r)["useful_per_s"]
        rows.append(
            f"| {seq_len} | {strategy} | {r['padding_pct']:.2f} | {r['truncated_pct']:.1f} "
            f"| {r['efficiency_pct']:.2f} | {100 * r['useful_share']:.1f} | "
            f"{r['step_ms']:,.0f} ms | {r['useful_per_s']:,.0f} | {r['useful_per_s'] / best:.2f} "
            f"| {r['useful_per_s'] / short:.2f} | {r['loss']:.3f} |"
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cache", default="", help="precook cache (default: a temporary one)")
    p.add_argument("--out", default="", help="write the results here (markdown)")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench(args, args.cache or tmp)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU, fp32"
    lines = [
        "# Packing strategies trained side by side: truncate (pad) vs re-bucket (bucket), 4K vs 8K",
        "",
        f"- machine: {machine()}; {device}; load average at the end {load} (shared machine)",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"torch {torch.__version__}",
        "- corpus: the Python standard library (*.py), BPE 4096, eval 2%",
        f"- model: {args.layers} layers, dim {args.dim}, {args.heads} heads; "
        f"{args.tokens_per_step} slots per step; {args.steps} timed steps per side after "
        f"{args.warmup} warm-up, interleaved in rotating order",
        f"- command: `{' '.join(['python3', *sys.argv])}`",
        "",
        *rows,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
