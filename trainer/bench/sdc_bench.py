"""What the SDC checks cost next to a training step (trainer/health/sdc.py, replay.py).

For three model sizes, on this process's device: the median time of one training step (forward,
backward, AdamW step on B x T random tokens), of `state_checksums` (bit sums of the parameters
and the optimizer state: the replica check's work) and of a replayed step (`ReplayChecker.run`:
snapshot, step, checksums, restore, step, checksums), measured in alternating rounds in one run,
and their ratios to the step. At one replica check every 50 steps it costs (check / step) / 50
of training time; at one replay every N steps, (replay / step - 1) / N.

    PYTHONPATH=.:.gen python trainer/bench/sdc_bench.py [--out FILE.md]
"""

import argparse
import datetime
import statistics
import time

import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.bench.machine import machine
from trainer.health.replay import ReplayChecker
from trainer.health.sdc import state_checksums
from trainer.lm_loss import summed_loss
from trainer.model import Transformer, attention_layout, select_ops

SIZES = {"guide (dim 64, 2 layers)": (64, 2), "tiny.yaml (256, 4)": (256, 4), "(512, 8)": (512, 8)}
VOCAB, BATCH, SEQ, ROUNDS = 4096, 4, 128, 5


def row(name: str, dim: int, layers: int, device: torch.device) -> str:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = dim, layers, 4
    cfg.data.seq_len, cfg.data.vocab_size = SEQ, VOCAB
    cfg = resolve_trainer(cfg)
    model = Transformer(cfg.model, VOCAB, ops=select_ops(False, device)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    layout = attention_layout(torch.zeros(BATCH, SEQ, dtype=torch.int32), device, torch.float32)

    def step() -> None:
        summed_loss(model, ids, positions, layout, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up; creates the optimizer state the check reads
    # every=0: not refused on a GPU; run() is called directly (a cost, not a verdict).
    replayer = ReplayChecker(0, device, torch.float32, "SINGLE")
    steps: list[float] = []
    checks: list[float] = []
    replays: list[float] = []
    timed = (
        (step, steps),
        (lambda: state_checksums(model, optimizer), checks),
        (lambda: replayer.run(1, step, model, optimizer, ()), replays),
    )
    for _ in range(ROUNDS):
        for fn, out in timed:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    s, c, r = statistics.median(steps), statistics.median(checks), statistics.median(replays)
    return (
        f"| {name} | {params / 1e6:.2f} M | {s * 1e3:,.1f} ms | {c * 1e3:,.1f} ms | {c / s:.3f} "
        f"| {r * 1e3:,.1f} ms | {r / s:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the table to this Markdown file")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [
        f"# SDC check cost ({datetime.date.today()}, {machine()}, {device.type}, "
        f"{torch.get_num_threads()} threads, fp32, batch {BATCH} x {SEQ})",
        "",
        "| model | parameters | training step | state_checksums | check / step "
        "| replayed step | replay / step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [row(name, dim, layers, device) for name, (dim, layers) in SIZES.items()]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
