"""nn.Module wrappers around the public ops, for models that compose layers.

Each layer takes `ops`: `kernels` (the fused Triton kernels where they run, see
`kernels.dispatch`) or `kernels.reference` (plain PyTorch, same signatures), so a model can
switch its kernels off without a second set of layers.
"""

from types import ModuleType

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, ops: ModuleType = kernels):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """w2(silu(w1(x)) * w3(x)), the Llama feed-forward block.

    The names are Llama's (w1 gate, w3 up, w2 down, registered in that order): they are the keys
    of checkpoints already written, and of the optimizer state, which follows parameter order.
    """

    def __init__(self, dim: int, hidden_dim: int, ops: ModuleType = kernels):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.swiglu(self.w1(x), self.w3(x)))


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from per-token positions, so packed documents restart at position 0.

    cos and sin are tables over positions 0 .. max_len - 1, looked up per token. They are
    non-persistent buffers: derived from (head_dim, max_len, base), never saved in a state dict.
    """

    def __init__(
        self, head_dim: int, max_len: int, base: float = 10000.0, ops: ModuleType = kernels
    ):
        super().__init__()
        # Angles in fp64, then cast: in fp32 the angle position * inv_freq rounds to fp32's
        # spacing at its size (2^-11 rad near 8191), so cos/sin at position 8191 were off by up
        # to 4e-4 (head_dim 128); from fp64 every entry is within fp32's own rounding (3e-8) of
        # the exact value, at any context length. Built once, so the fp64 costs nothing per step.
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.ops = ops

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (batch, seq, head_dim) for position_ids (batch, seq), each < max_len."""
        return self.cos[position_ids], self.sin[position_ids]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(position_ids)
        return self.ops.apply_rope(q, k, cos, sin)


class CrossEntropyLoss(nn.Module):
    def __init__(
        self, ignore_index: int = -100, reduction: str = "mean", ops: ModuleType = kernels
    ):
        super().__init__()
        self.ignore_index, self.reduction, self.ops = ignore_index, reduction, ops

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.ops.cross_entropy(logits, target, self.ignore_index, self.reduction)


class FusedLinearCrossEntropyLoss(nn.Module):
    """Loss of an output projection (e.g. the LM head's weight) without materializing logits."""

    def __init__(
        self, ignore_index: int = -100, reduction: str = "mean", ops: ModuleType = kernels
    ):
        super().__init__()
        self.ignore_index, self.reduction, self.ops = ignore_index, reduction, ops

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return self.ops.fused_linear_cross_entropy(
            hidden, weight, target, self.ignore_index, self.reduction
        )
