"""AdamW and the learning-rate schedule: linear warmup, then cosine, linear or constant."""

import math

import torch

from protos.enums import enum_name


def build_optimizer(model: torch.nn.Module, cfg, device) -> torch.optim.AdamW:
    """AdamW over `model` with `cfg` (a resolved OptimConfig); fused on CUDA.

    Matrices and embeddings decay; norm weights (1-D) do not, as in GPT-2 and Llama.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        fused=torch.device(device).type == "cuda",
    )


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """The multiple of `cfg.lr` used for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    schedule = enum_name(cfg, "schedule")
    if schedule == "CONSTANT":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "COSINE" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
