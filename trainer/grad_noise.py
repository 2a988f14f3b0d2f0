"""Gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A): the batch size, in tokens, beyond which a bigger batch buys little.

Each step gives two gradient norms of the same weights: one micro-batch (B_small tokens) and
the whole step (B_big tokens). From them, unbiased estimates of the true gradient's squared
norm |G|^2 and of the per-token noise trace S follow; B_simple = S / |G|^2, with both
smoothed by an exponential moving average before dividing, as the paper does. The estimator
itself is the one the sizing tools use (trainer.sizing.batch).

The micro-batch norm is each rank's own (`MicroBatchGradNorm`, averaged over ranks): one
micro-batch on one rank, B_small = its tokens. It is read from the gradients as autograd
produces them, not from `p.grad`, so it is the same number under DDP (whose first micro-batch
is not synchronized) and FSDP2 (whose parameters' `.grad` holds reduce-scattered shards, and
whose unsynchronized gradients sit on the unsharded parameters it swaps in for each layer's
forward); the whole step's norm is the clipping norm, which under FSDP2 is the DTensor norm:
local squared norms of the gradient shards, all-reduced.
"""

import torch

from trainer.sizing.batch import noise_scale_from_two_batches

DECAY = 0.95
CHUNK = 1 << 24  # elements squared at once by MicroBatchGradNorm


class GradientNoiseScale:
    def __init__(self):
        self.g2 = self.s = 0.0  # moving averages, bias-corrected by `weight`
        self.weight = 0.0

    def update(self, small_sq: float, b_small: float, big_sq: float, b_big: float) -> None:
        """Squared norms of the mean per-token gradient over b_small and b_big tokens."""
        if not 0 < b_small < b_big:
            return
        g2, s = noise_scale_from_two_batches(b_small, small_sq, b_big, big_sq)
        self.g2 = DECAY * self.g2 + (1 - DECAY) * g2
        self.s = DECAY * self.s + (1 - DECAY) * s
        self.weight = DECAY * self.weight + (1 - DECAY)

    @property
    def value(self) -> float:
        """B_simple in tokens; 0 while unknown (no estimate yet, or |G|^2 not yet positive)."""
        if self.weight == 0 or self.g2 <= 0:
            return 0.0
        return self.s / self.g2

    def state_dict(self) -> dict:
        return {"g2": self.g2, "s": self.s, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.s, self.weight = state["g2"], state["s"], state["weight"]


class MicroBatchGradNorm:
    """The squared norm of the gradient one backward pass computes, summed per parameter by
    tensor hooks as autograd produces it (before it is accumulated into `.grad`).

    Hooks go on the parameters each module holds when it runs (a forward pre-hook on every
    module with parameters of its own): the model's own parameters under DDP or in one
    process, the unsharded ones FSDP2 gathers for the layer's forward. Open it before the
    forward pass; `close()` after the backward pass returns the squared norm."""

    def __init__(self, model: torch.nn.Module):
        self.parts: list[torch.Tensor] = []
        self.hooked: set[int] = set()  # a tied or recomputed parameter counts once
        self.handles = [
            m.register_forward_pre_hook(self._hook_parameters)
            for m in model.modules()
            if any(p is not None for p in m._parameters.values())
        ]

    def _hook_parameters(self, module: torch.nn.Module, args) -> None:
        for p in module._parameters.values():
            if p is not None and p.requires_grad and id(p) not in self.hooked:
                self.hooked.add(id(p))
                self.handles.append(p.register_hook(self._add))

    def _add(self, grad: torch.Tensor) -> None:
        # Squares summed in float64, a chunk at a time (a float32 temporary of at most 2^24
        # elements): torch's float32 norm on CPU was off by 4e-4 on the 1M-element embedding
        # gradient of the tiny model, more than the DDP-versus-FSDP test allows.
        flat = grad.detach().reshape(-1)
        for chunk in flat.split(CHUNK):
            chunk = chunk.float()
            self.parts.append(torch.sum(chunk * chunk, dtype=torch.float64))

    def close(self) -> float:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return float(torch.stack(self.parts).sum()) if self.parts else 0.0
