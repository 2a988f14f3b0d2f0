"""Fused training ops: Triton kernels with PyTorch references of identical signature.

    import kernels
    y = kernels.rms_norm(x, weight)
    loss = kernels.fused_linear_cross_entropy(hidden, lm_head.weight, labels)

Each op runs compiled Triton on CUDA, interpreted Triton on CPU when TRITON_INTERPRET=1 was set
before import, and `kernels.reference` otherwise (see `kernels.dispatch`). Inputs may be fp32,
fp16 or bf16; compute is fp32 inside; outputs keep the input dtype; losses are fp32.
"""

import torch

from kernels import checks, reference
from kernels.dispatch import TRITON_IMPORTABLE, triton_available, use_triton

if TRITON_IMPORTABLE:
    from kernels.ops import cross_entropy as _cross_entropy
    from kernels.ops import fused_linear_cross_entropy as _flce
    from kernels.ops import grouped_gemm as _grouped_gemm
    from kernels.ops import rms_norm as _rms_norm
    from kernels.ops import rope as _rope
    from kernels.ops import swiglu as _swiglu

__all__ = [
    "apply_rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "grouped_gemm",
    "reference",
    "rms_norm",
    "swiglu",
    "triton_available",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight; weight has shape (x.shape[-1],)."""
    checks.rms_norm(x, weight)
    if use_triton(x):
        return _rms_norm.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up share shape and dtype."""
    checks.swiglu(gate, up)
    if use_triton(gate):
        return _swiglu.swiglu(gate, up)
    return reference.swiglu(gate, up)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q (B, S, H, D) and k (B, S, KVH, D) with per-token cos and
    sin (B, S, D) (a size-1 batch broadcasts). Returns (q_out, k_out)."""
    checks.apply_rope(q, k, cos, sin)
    # The kernel treats cos/sin as constants; the rare caller that learns them gets the reference.
    if use_triton(q) and not (cos.requires_grad or sin.requires_grad):
        return _rope.apply_rope(q, k, cos, sin)
    return reference.apply_rope(q, k, cos, sin)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Cross entropy of logits (..., vocab) against target (...). "mean" averages over targets
    that are not ignore_index and is 0 when all are ignored; "none" has target's shape."""
    checks.cross_entropy(logits, target, reduction)
    if use_triton(logits):
        return _cross_entropy.cross_entropy(logits, target, ignore_index, reduction)
    return reference.cross_entropy(logits, target, ignore_index, reduction)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target) for hidden (tokens, dim) and weight (vocab, dim),
    without materializing the tokens x vocab logits on the Triton path."""
    checks.fused_linear_cross_entropy(hidden, weight, target, reduction)
    if use_triton(hidden):
        return _flce.fused_linear_cross_entropy(hidden, weight, target, ignore_index, reduction)
    return reference.fused_linear_cross_entropy(hidden, weight, target, ignore_index, reduction)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """x (M, K) whose rows come in consecutive groups of `group_sizes`; group g is multiplied
    by w[g] (K, N): out (M, N) in x's dtype. The mixture-of-experts expert matmul."""
    checks.grouped_gemm(x, w, group_sizes)
    if use_triton(x):
        return _grouped_gemm.grouped_gemm(x, w, group_sizes)
    return reference.grouped_gemm(x, w, group_sizes)
