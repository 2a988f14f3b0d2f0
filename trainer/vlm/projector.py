"""Vision features -> language-model embeddings: pixel shuffle, then a two-layer MLP.

Pixel shuffle (SmolVLM / Idefics3) folds each r x r block of neighbouring patches into one
token with r^2 times the width: an image of 8 x 8 patches becomes 4 x 4 = 16 tokens at r = 2.
The LM's cost grows with every token it reads, so an image costs r^2 fewer of them, and the
MLP (LLaVA-1.5's projector) learns to read the folded neighbourhood.
"""

import torch
import torch.nn as nn


def pixel_shuffle(x: torch.Tensor, grid: int, r: int) -> torch.Tensor:
    """(B, grid*grid, D) in row-major patch order -> (B, (grid/r)^2, D*r*r)."""
    B, _, D = x.shape
    g = grid // r
    x = x.view(B, g, r, g, r, D).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, g * g, r * r * D)


class Projector(nn.Module):
    def __init__(self, vision_dim: int, grid: int, shuffle: int, lm_dim: int):
        super().__init__()
        self.grid, self.shuffle = grid, shuffle
        self.fc1 = nn.Linear(vision_dim * shuffle * shuffle, lm_dim)
        self.fc2 = nn.Linear(lm_dim, lm_dim)

    @property
    def image_tokens(self) -> int:
        return (self.grid // self.shuffle) ** 2

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = pixel_shuffle(features, self.grid, self.shuffle)
        return self.fc2(nn.functional.gelu(self.fc1(x)))

    def matmul_params(self) -> int:
        return self.fc1.weight.numel() + self.fc2.weight.numel()
