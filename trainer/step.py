"""One training step's compute and its accounting: the micro-batches' token counts agreed
across ranks, forward and backward of every micro-batch, clipping, and which steps are reported.

The loss is the mean over every unit (labelled token, pair, ...) of the global batch, however
they are split into micro-batches and ranks: each micro-batch's summed loss is scaled by
world / n_tokens before backward, so the gradients data parallelism averages over ranks are
that mean's.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from protos import trainer_config_pb2
from trainer import distributed, expert_parallel
from trainer.grad_noise import GradientNoiseScale, MicroBatchGradNorm
from trainer.recipe import BatchCounts

if TYPE_CHECKING:
    from trainer.parallel.engine import Engine


@dataclasses.dataclass
class StepCounts:
    """What the ranks agree on before a step's compute."""

    labelled: float  # tokens that carry a label, in the global batch
    padding: float  # padded positions, in the global batch
    stop: bool  # some rank was asked to stop: the step is not taken


def agree_counts(
    counts: list[BatchCounts], stop: bool, copies: int, device: torch.device
) -> StepCounts:
    """Sum this rank's counts over every rank. `copies`: ranks that read the same rows (a
    model-parallel layout), whose rows are counted once."""
    labelled = sum(c.units for c in counts)
    padding = sum(c.positions - c.tokens for c in counts)
    local = [labelled, padding, int(stop)]
    agreed = distributed.all_reduce_sum(
        torch.tensor(local, dtype=torch.float64, device=device)
    ).tolist()
    return StepCounts(agreed[0] / copies, agreed[1] / copies, agreed[2] > 0)


def batch_positions(counts: list[BatchCounts], world_size: int, copies: int) -> int:
    """Token positions the global batch holds (padding included)."""
    return sum(c.positions for c in counts) * (world_size // copies)


def is_logged(step: int, first_step: int, train: trainer_config_pb2.TrainConfig) -> bool:
    """Whether step `step` (1-based) is reported: every `log_every`, this process's first
    step (`first_step` + 1) and the last."""
    return step % train.log_every == 0 or step in (first_step + 1, train.steps)


def engine_step(
    engine: "Engine", batches: list[dict], n_tokens: float, grad_clip: float
) -> tuple[float, float]:
    """`train_step` under a model-parallel layout: the engine schedules the micro-batches."""
    share = engine.forward_backward(batches, n_tokens)
    grad_norm = engine.clip(grad_clip)
    return float(distributed.all_reduce_sum(share.view(1))[0]) / n_tokens, grad_norm


def train_step(
    model: torch.nn.Module,
    batches: list[dict],
    n_tokens: float,
    *,
    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor],
    units: list[float],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    noise: GradientNoiseScale,
    device: torch.device,
    dtype: torch.dtype,
    autocast: bool,
    grad_clip: float,
    world_size: int,
) -> tuple[float, float]:
    """Forward/backward every micro-batch, then clip; returns (mean loss, grad norm).
    `n_tokens`: the loss's units in the global batch (all micro-batches, all ranks);
    `loss_fn(model, batch)`: the recipe's summed loss; `units`: each micro-batch's units;
    `autocast`: whether the forward runs under autocast to `dtype` (not under FSDP, whose
    parameters are already in it)."""
    accum, world = len(batches), world_size
    autocast_ctx = torch.autocast(
        device.type, dtype=dtype, enabled=dtype != torch.float32 and autocast
    )
    # Per-micro-batch gradient norms feed the noise scale (grad_noise.py, under DDP and
    # FSDP alike); one micro-batch on one rank has no smaller batch to compare with.
    measure_noise = accum > 1
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    small = torch.zeros(2, device=device, dtype=torch.float64)
    for k, b in enumerate(batches):
        with distributed.gradient_sync(model, k == accum - 1), autocast_ctx:
            loss = loss_fn(model, b)
        probe = MicroBatchGradNorm(loss) if k == 0 and measure_noise else None
        scaler.scale(loss * (world / n_tokens)).backward()
        loss_sum += loss.detach()
        if probe is not None:
            n_small = float(units[k])
            # The accumulated gradient is sum-loss * world / n_tokens: rescale to a mean.
            scale = n_tokens / (world * max(n_small, 1.0))
            # Under fp16 the gradients are still multiplied by the loss scale here.
            small[0] = probe.close() * (scale / scaler.get_scale()) ** 2
            small[1] = n_small
    totals = distributed.all_reduce_sum(torch.cat([loss_sum.view(1), small]))
    clip = grad_clip or math.inf
    scaler.unscale_(optimizer)  # clip the true gradients (no-op unless fp16)
    if isinstance(model, expert_parallel.ExpertParallel):  # a norm over all experts
        grad_norm = model.clip_grad_norm_(clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    if measure_noise:
        noise.update(float(totals[1]) / world, float(totals[2]) / world, grad_norm**2, n_tokens)
    return float(totals[0]) / n_tokens, grad_norm
