"""nn.Module wrappers around the public ops, for models that compose layers."""

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama feed-forward block."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from per-token positions, so packed documents restart at position 0."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (batch, seq, head_dim) in fp32 for position_ids (batch, seq)."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(position_ids)
        return kernels.apply_rope(q, k, cos, sin)


class CrossEntropyLoss(nn.Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kernels.cross_entropy(logits, target, self.ignore_index, self.reduction)


class FusedLinearCrossEntropyLoss(nn.Module):
    """Loss of an output projection (e.g. the LM head's weight) without materializing logits."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return kernels.fused_linear_cross_entropy(
            hidden, weight, target, self.ignore_index, self.reduction
        )
