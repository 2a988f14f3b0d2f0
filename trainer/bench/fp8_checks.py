"""fp8 training (train.dtype fp8, trainer/fp8.py) against bf16 on the GPU: loss and step time.

The same model, data and seed trained twice through the real Trainer, torch.compile on (the
amax, scale and cast kernels fuse only when compiled, as in torchao's measurements), once in
bf16 and once with float8 linears. Two checks, each a goal line:

1. fp8's loss tracks bf16's: mean |fp8 - bf16| over the last quarter of the steps within
   `LOSS_TOLERANCE` nats, and fp8 falls at least 80% as far;
2. an fp8 step is no slower than a bf16 step: the median step time after the compile
   warm-up (`WARMUP_STEPS`), printed as the speed-up bf16 / fp8. The model is wide (dim 4096,
   Llama-3-8B's width, few layers) because fp8's gain grows with the matmul size.

Where the device has no fp8 matmuls (CPU, verify's tiny mode; CUDA capability < 8.9) both
checks are reported as skipped with the reason, never run in an emulation that would say
nothing about speed (the numerics are tested on CPU by trainer/fp8_test.py).

    PYTHONPATH=.:.gen python3 trainer/bench/fp8_checks.py --json OUT.json [--cache-dir DIR]

Run by tools/gpu/verify.py (step "fp8").
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

from protos.config_yaml import ConfigError
from trainer import fp8
from trainer.bench.precision_checks import Check, report, run_config, train_records
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv

LOSS_TOLERANCE = 0.1  # nats: e4m3/e5m2 round harder than bf16 (2^-4, 2^-3 vs 2^-8 relative)
SPEEDUP_GOAL = 1.0  # fp8 step time <= bf16 step time
WARMUP_STEPS = 5  # compile and autotuning happen in the first steps
LOSS_GOAL = f"mean |fp8 - bf16| over the last quarter <= {LOSS_TOLERANCE} nats"
SPEED_GOAL = f"median step time bf16 / fp8 >= {SPEEDUP_GOAL:.1f}x (after {WARMUP_STEPS} steps)"


def _fp8_config():
    """precision_checks' data and schedule (its precooked dataset is reused), a wide model."""
    cfg = run_config(tiny=False)
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads = 4096, 4, 32, 8
    m.ffn_dim = 14336  # Llama-3-8B's MLP
    cfg.train.micro_batch, cfg.train.steps, cfg.train.compile = 8, 40, True
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
    return cfg


def skip_reason(device: torch.device) -> str | None:
    """Why fp8 cannot be measured here (the trainer's own device rule), or None."""
    try:
        fp8.backend_for(device)
    except ConfigError:
        if device.type != "cuda":
            return f"skipped: no fp8 matmul on {device.type}"
        major, minor = torch.cuda.get_device_capability(device)
        return f"skipped: no fp8 matmul on {torch.cuda.get_device_name(device)} ({major}.{minor})"
    return None


def fp8_vs_bf16(device: torch.device, cache_dir: str) -> list[Check]:
    skipped = skip_reason(device)
    if skipped:
        return [
            Check("fp8 loss tracks bf16", LOSS_GOAL, "-", skipped),
            Check("fp8 step time vs bf16", SPEED_GOAL, "-", skipped),
        ]
    cfg = _fp8_config()
    ds = precook_dataset(cfg.data, cache_dir, show_progress=False)
    env = DistEnv(0, 1, 0, device)
    runs = {dtype: train_records(cfg, ds, env, dtype) for dtype in ("bf16", "fp8")}
    loss = {d: [p.loss for p in records] for d, records in runs.items()}
    tail = max(1, len(loss["bf16"]) // 4)
    pairs = zip(loss["fp8"][-tail:], loss["bf16"][-tail:], strict=True)
    gap = statistics.fmean(abs(a - b) for a, b in pairs)
    fell = {d: values[0] - values[-1] for d, values in loss.items()}
    step = {
        d: statistics.median(p.step_time_seconds for p in records[WARMUP_STEPS:])
        for d, records in runs.items()
    }
    speedup = step["bf16"] / step["fp8"]
    compiled = "on" if cfg.train.compile else "off"
    shape = (
        f"{cfg.model.n_layers}x{cfg.model.dim}, ffn {cfg.model.ffn_dim}, seq "
        f"{cfg.data.seq_len}, {cfg.train.micro_batch} rows, compile {compiled}"
    )
    return [
        Check(
            "fp8 loss tracks bf16",
            LOSS_GOAL + "; fp8 falls at least 80% as far",
            f"{gap:.4f} nats; bf16 {loss['bf16'][0]:.3f} -> {loss['bf16'][-1]:.3f}, fp8 "
            f"{loss['fp8'][0]:.3f} -> {loss['fp8'][-1]:.3f} ({len(loss['fp8'])} steps, {shape})",
            "met" if gap <= LOSS_TOLERANCE and fell["fp8"] > 0.8 * fell["bf16"] else "MISS",
        ),
        Check(
            "fp8 step time vs bf16",
            SPEED_GOAL,
            f"{speedup:.2f}x: bf16 {step['bf16'] * 1e3:.1f} ms, fp8 {step['fp8'] * 1e3:.1f} ms "
            f"per step ({shape})",
            "met" if speedup >= SPEEDUP_GOAL else "MISS",
        ),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the checks here")
    p.add_argument("--cache-dir", default=".state/precook", help="precooked datasets")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return report(fp8_vs_bf16(device, args.cache_dir), args.json)


if __name__ == "__main__":
    sys.exit(main())
