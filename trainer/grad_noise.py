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
whose unsynchronized gradients sit on the unsharded parameters it gathers for each layer);
the whole step's norm is the clipping norm, which under FSDP2 is the DTensor norm: local
squared norms of the gradient shards, all-reduced.
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

    The parameters are the leaves the loss's graph ends in (its AccumulateGrad nodes): the
    model's own under DDP or in one process, the unsharded ones FSDP2 gathered for each
    layer. Found from the graph, not from module hooks, so compiled blocks (torch.compile
    traces module hooks once and does not see later ones) and FSDP2's private state play no
    part. Open it on the loss before its backward pass; `close()` after it returns the norm."""

    def __init__(self, loss: torch.Tensor):
        self.parts: list[torch.Tensor] = []
        self.handles = []
        seen: set[int] = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node's parameter
            if leaf is not None:
                self.handles.append(leaf.register_hook(self._add))
            stack.extend(next_node for next_node, _ in node.next_functions)

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
