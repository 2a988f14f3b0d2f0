"""PyTorch references: the semantics every Triton op must match, and the CPU fallback.

Same signatures as the public ops in `kernels`. Compute is fp32 inside; outputs keep the input
dtype and losses are fp32. Written the plain way a model would write them (this is also the
"eager" side of the benchmark), with no attempt at saving memory.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE. q (B, S, H, D), k (B, S, KVH, D), cos and sin (B, S, D) per token, so
    positions can restart at each packed document."""
    cos = cos.float().unsqueeze(2)
    sin = sin.float().unsqueeze(2)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + _rotate_half(q32) * sin
    k_out = k32 * cos + _rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy over the last dim of `logits` (..., vocab) with `target` (...).

    "mean" divides by the number of targets that are not `ignore_index`, and gives 0 (with zero
    gradients) when every target is ignored, where `F.cross_entropy` would give NaN: a batch of
    prompt-only SFT rows must not poison the weights. "none" returns target's shape with 0 at
    ignored positions.
    """
    vocab = logits.shape[-1]
    flat_target = target.reshape(-1).long()
    per_token = F.cross_entropy(
        logits.reshape(-1, vocab).float(), flat_target, ignore_index=ignore_index, reduction="none"
    )
    if reduction == "none":
        return per_token.reshape(target.shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (flat_target != ignore_index).sum().clamp(min=1)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target): the logits are materialized in full here."""
    return cross_entropy(hidden @ weight.t(), target, ignore_index, reduction)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """x (M, K) in consecutive row groups, group g times w[g] (K, N): out (M, N). One matmul per
    group, computed in fp32."""
    parts = torch.split(x, list(group_sizes))
    outs = [rows.float() @ w[g].float() for g, rows in enumerate(parts)]
    out = torch.cat(outs) if outs else x.new_zeros(0, w.shape[2], dtype=torch.float32)
    return out.to(x.dtype)
