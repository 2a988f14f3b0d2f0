"""A small ViT patch encoder, trained from scratch: patches -> pre-norm blocks -> features.

Non-overlapping patch_size x patch_size patches are embedded by one strided convolution (a
matmul per patch), given learned positions, and run through `n_layers` bidirectional blocks
built from Kitchen's own layers (RMSNorm and SwiGLU from `kernels.modules`, so the fused
Triton ops serve here too where they run). No class token: the projector wants every patch.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.modules import RMSNorm, SwiGLUMLP
from protos.defaults import ffn_dim_for
from protos.trainer_config_pb2 import VisionConfig

# Pixel statistics are not learned from the data: uint8 images map to [-1, 1].
PIXEL_SCALE = 127.5


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ops):
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm = RMSNorm(dim, 1e-5, ops)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim, 1e-5, ops)
        self.feed_forward = SwiGLUMLP(dim, ffn_dim_for(dim), ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, P, D = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(B, P, 3, self.n_heads, -1).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        h = x + self.wo(out.transpose(1, 2).reshape(B, P, D))
        return h + self.feed_forward(self.ffn_norm(h))


class VisionEncoder(nn.Module):
    """(B, S, S, 3) uint8 images -> (B, patches, dim) features, patches = (S / patch_size)^2."""

    def __init__(self, cfg: VisionConfig, ops):
        super().__init__()
        self.grid = cfg.image_size // cfg.patch_size
        self.patch_embed = nn.Conv2d(3, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.position = nn.Parameter(torch.randn(1, self.grid * self.grid, cfg.dim) * 0.02)
        self.layers = nn.ModuleList(
            EncoderBlock(cfg.dim, cfg.n_heads, ops) for _ in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, 1e-5, ops)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).to(self.position.dtype) / PIXEL_SCALE - 1.0
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.position
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def matmul_params(self) -> int:
        """Weights used in a matmul per patch (the positions are an addition)."""
        return sum(p.numel() for p in self.layers.parameters()) + self.patch_embed.weight.numel()
