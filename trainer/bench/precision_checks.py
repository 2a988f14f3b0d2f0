"""Numerics of the GPU path, each a check with a measured number and a verdict.

1. bf16 tracks fp32: the same model, data and seed trained twice, in fp32 and in bf16 autocast
   (fp32 master weights), through the real Trainer. Goal: the bf16 loss stays within
   `LOSS_TOLERANCE` nats of the fp32 loss, averaged over the last quarter of the steps, and the
   two runs fall by about the same amount. bf16 keeps 8 bits of mantissa, so the curves are
   not equal: they must tell the same story.
2. The variable-length attention path equals the masked one: one batch of packed rows (random
   document boundaries) through the model twice in bf16, once with `cu_seqlens` (torch's
   varlen flash attention, what the trainer uses on CUDA) and once with the dense
   per-document mask. Goal: logits and every gradient within bf16 rounding
   (relative L2 error <= `VARLEN_TOLERANCE`). Needs CUDA; elsewhere it is reported as skipped.

    PYTHONPATH=.:.gen python3 trainer/bench/precision_checks.py [--tiny] --json OUT.json

Run by tools/gpu/verify.py; `--tiny` is its CPU mode (a small model, a few steps).
"""

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from protos import files, trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.model import Layout, Transformer, attention_layout, varlen_attn
from trainer.recipes.lm import lm_trainer

LOSS_TOLERANCE = 0.05  # nats, mean |bf16 - fp32| over the last quarter of the steps
VARLEN_TOLERANCE = 2e-2  # relative L2 error, a few bf16 ulps (2^-8 = 3.9e-3 per rounding)


@dataclasses.dataclass
class Check:
    name: str
    goal: str
    measured: str
    verdict: str  # "met", "MISS" or "skipped: why"


def report(checks: list[Check], json_path: Path) -> int:
    """Writes the checks (tools/gpu/verify.py reads them), prints one line each; exit status
    1 when a goal was missed."""
    files.write_json_atomic(str(json_path), [dataclasses.asdict(c) for c in checks])
    for c in checks:
        print(f"{c.verdict:>7}  {c.name}: {c.measured}", file=sys.stderr)
    return 0 if all(c.verdict != "MISS" for c in checks) else 1


def run_config(tiny: bool) -> trainer_config_pb2.TrainerConfig:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.max_documents = 50 if tiny else 0  # tiny: the trainer bench's dataset, cached
    cfg.data.seq_len = 128 if tiny else 1024
    m = cfg.model
    m.dim, m.n_layers, m.n_heads = (64, 2, 4) if tiny else (768, 12, 12)
    cfg.train.micro_batch = 4 if tiny else 16
    cfg.train.steps = 40 if tiny else 200
    cfg.train.log_every, cfg.train.eval_every = 1, 0
    cfg.optim.warmup_steps = 5 if tiny else 20
    cfg.checkpoint.every_steps = 0
    return resolve_trainer(cfg)


def _losses(cfg, ds, env, dtype: str) -> list[float]:
    return [p.loss for p in train_records(cfg, ds, env, dtype)]


def train_records(cfg, ds, env, dtype: str) -> list:
    """The train-phase progress records of one run of `cfg` with `train.dtype` = `dtype`."""
    run = trainer_config_pb2.TrainerConfig()
    run.CopyFrom(cfg)
    run.train.dtype = dtype
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = lm_trainer(
            run, run_dir, env, ds.path, ds.tokenizer.vocab_size, log=lambda _: None
        )
        records: list = []
        trainer.metrics.sinks.append(records.append)
        while trainer.step < run.train.steps:
            trainer.advance()
    return [p for p in records if p.phase == "train"]


def bf16_tracks_fp32(tiny: bool, device: torch.device, cache_dir: str) -> Check:
    cfg = run_config(tiny)
    ds = precook_dataset(cfg.data, cache_dir, show_progress=False)
    env = DistEnv(0, 1, 0, device)
    fp32, bf16 = _losses(cfg, ds, env, "float32"), _losses(cfg, ds, env, "bfloat16")
    tail = max(1, len(fp32) // 4)
    gap = statistics.fmean(abs(a - b) for a, b in zip(fp32[-tail:], bf16[-tail:], strict=True))
    fell32, fell16 = fp32[0] - fp32[-1], bf16[0] - bf16[-1]
    ok = gap <= LOSS_TOLERANCE and fell16 > 0.8 * fell32
    return Check(
        "bf16 loss tracks fp32",
        f"mean |bf16 - fp32| over the last {tail} steps <= {LOSS_TOLERANCE} nats; bf16 falls "
        "at least 80% as far",
        f"{gap:.4f} nats; fp32 {fp32[0]:.3f} -> {fp32[-1]:.3f}, bf16 {bf16[0]:.3f} -> "
        f"{bf16[-1]:.3f} ({len(fp32)} steps, {cfg.model.n_layers}x{cfg.model.dim}, "
        f"seq {cfg.data.seq_len})",
        "met" if ok else "MISS",
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def varlen_matches_masked(tiny: bool, device: torch.device) -> Check:
    goal = f"logits and gradients, relative L2 error <= {VARLEN_TOLERANCE}"
    name = "varlen attention equals the masked path"
    if device.type != "cuda" or varlen_attn() is None:
        return Check(name, goal, "-", "skipped: needs CUDA and torch's varlen_attn")
    cfg = run_config(tiny).model
    torch.manual_seed(0)
    model = Transformer(cfg, 4096).to(device)  # the reference ops: attention is the subject
    B, T = 4, cfg.max_seq_len
    starts = torch.rand(B, T) < 4 / T  # ~4 documents per row, at random places
    starts[:, 0] = True
    doc = starts.long().cumsum(1)
    positions = torch.stack([_positions(row) for row in starts])
    ids = torch.randint(0, 4096, (B, T))
    labels = torch.roll(ids, -1, dims=1)
    varlen = attention_layout(doc, device, torch.bfloat16)
    masked = attention_layout(doc, device, torch.float32)  # fp32 picks the mask
    assert varlen.cu_seqlens is not None and masked.mask is not None
    outs = [
        _forward_backward(model, ids, positions, labels, layout, device)
        for layout in (varlen, masked)
    ]
    worst = max(_rel(a, b) for a, b in zip(outs[0], outs[1], strict=True))
    return Check(
        name,
        goal,
        f"worst relative error {worst:.2e} over logits and {len(outs[0]) - 1} grads",
        "met" if worst <= VARLEN_TOLERANCE else "MISS",
    )


def _positions(starts: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at each document start."""
    idx = torch.arange(len(starts))
    last_start = torch.cummax(torch.where(starts, idx, 0), 0).values
    return idx - last_start


def _forward_backward(model, ids, positions, labels, layout: Layout, device) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(ids.to(device), positions.to(device), layout)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten()).backward()
    return [logits.detach()] + [
        p.grad.detach().clone() for p in model.parameters() if p.grad is not None
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU mode: a small model, a few steps")
    p.add_argument("--json", type=Path, required=True, help="write the checks here")
    p.add_argument("--cache-dir", default=".state/precook", help="precooked datasets")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checks = [
        bf16_tracks_fp32(args.tiny, device, args.cache_dir),
        varlen_matches_masked(args.tiny, device),
    ]
    return report(checks, args.json)


if __name__ == "__main__":
    sys.exit(main())
