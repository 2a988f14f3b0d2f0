"""What one packed step costs at 8K against 4K: the same tokens, rows twice as long.

    ./bazel run //trainer/bench:attention_scaling_bench -- \
        --out $PWD/trainer/bench/attention_scaling_cpu.md

docs/precook_scale.md section 3 trains best_fit rows at 4K and 8K; the step itself is measured
here, alone: the packing benchmark's model (2 layers, dim 64, 2 heads, 4,096 ids), forward and
backward over the same number of tokens as R rows of 4,096 and R/2 rows of 8,192, documents of
2,042 tokens (the whole standard library's median) packed end to end and masked apart. On the
CPU, attention runs over a dense T x T mask, so its work per token doubles from 4K to 8K; the
rest of the step (embeddings, MLPs, the output head and the loss) costs the same per token. The
two sides alternate, the median of each is reported, and their ratio.
"""

import argparse
import datetime
import statistics
import time

import torch

from protos import trainer_config_pb2 as pb
from protos.validation import resolve_trainer
from trainer import model_setup
from trainer.bench.machine import machine
from trainer.lm_loss import summed_loss
from trainer.model import attention_layout

VOCAB, DOCUMENT = 4096, 2042


def side(seq_len: int, rows: int):
    """A step function: forward and backward of `rows` packed rows of `seq_len` tokens."""
    cfg = pb.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 64, 2, 2
    cfg.data.seq_len, cfg.data.vocab_size = seq_len, VOCAB
    model = model_setup.build_model(resolve_trainer(cfg), VOCAB, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (rows, seq_len))
    positions = (torch.arange(seq_len) % DOCUMENT).expand(rows, seq_len)
    documents = (torch.arange(seq_len) // DOCUMENT).expand(rows, seq_len).contiguous()
    layout = attention_layout(documents, "cpu", torch.float32)

    def step() -> float:
        start = time.perf_counter()
        summed_loss(model, ids, positions, layout, ids).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step, both sides")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="also write the result (markdown) here")
    a = p.parse_args()
    torch.manual_seed(0)
    short, long = side(4096, a.tokens // 4096), side(8192, a.tokens // 8192)
    short(), long()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(a.rounds):
        times[0].append(short())
        times[1].append(long())
    t4, t8 = statistics.median(times[0]), statistics.median(times[1])
    lines = [
        f"machine: {machine()}; torch {torch.__version__}, fp32; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{a.rounds} alternating rounds after a warm-up",
        "",
        "| rows x T | step (median) | tokens/s | vs 4K |",
        "|---|---|---|---|",
        f"| {a.tokens // 4096} x 4096 | {t4:.2f} s | {a.tokens / t4:,.0f} | 1.00 |",
        f"| {a.tokens // 8192} x 8192 | {t8:.2f} s | {a.tokens / t8:,.0f} | {t4 / t8:.2f} |",
    ]
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
