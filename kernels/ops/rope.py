"""Rotary position embedding (rotate-half convention) applied to q and k in one launch.

Eager PyTorch builds rotate_half(x) with a slice, a negation and a concatenation, then two
multiplies and an add, for q and again for k: about ten kernels and several full-size
temporaries. Here each program loads a tile of tokens' cos/sin once and rotates every q and k
head of those tokens in registers. cos/sin are per token (batch, seq, head_dim), so packed
documents restart positions at 0; a cos/sin broadcast over the batch (stride 0) is read without
copying.
"""

import torch
import triton
import triton.language as tl

from kernels.ops.utils import compile_safe, distinct, rows_per_tile


@triton.jit
def _rotate_heads(
    X, x_sb, x_ss, x_sh, OUT, o_sb, o_ss, o_sh, b, s, token_mask, n_heads, half,
    c1, c2, s1, s2, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """Rotates every head of a tile of tokens; b, s, token_mask are (BLOCK_T, 1, 1)."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = token_mask & (heads < n_heads) & (dims < half)
    x_ptr = X + b * x_sb + s * x_ss + heads * x_sh + dims
    o_ptr = OUT + b * o_sb + s * o_ss + heads * o_sh + dims
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    # Forward: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
    # Backward is its transpose: the sin terms swap halves and change sign.
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(o_ptr, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_ptr + half, o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, q_sb, q_ss, q_sh, K, k_sb, k_ss, k_sh,
    QO, qo_sb, qo_ss, qo_sh, KO, ko_sb, ko_ss, ko_sh,
    COS, cos_sb, cos_ss, SIN, sin_sb, sin_ss,
    n_tokens, seq_len, n_q_heads, n_k_heads, half,
    BLOCK_T: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    token_mask = tokens < n_tokens
    b = tokens // seq_len
    s = tokens % seq_len
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    cs_mask = token_mask & (dims < half)
    cos_ptr = COS + b * cos_sb + s * cos_ss + dims
    sin_ptr = SIN + b * sin_sb + s * sin_ss + dims
    c1 = tl.load(cos_ptr, mask=cs_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + half, mask=cs_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr, mask=cs_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + half, mask=cs_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        Q, q_sb, q_ss, q_sh, QO, qo_sb, qo_ss, qo_sh, b, s, token_mask, n_q_heads, half,
        c1, c2, s1, s2, BLOCK_QH, BLOCK_HALF, BACKWARD,
    )  # fmt: skip
    _rotate_heads(
        K, k_sb, k_ss, k_sh, KO, ko_sb, ko_ss, ko_sh, b, s, token_mask, n_k_heads, half,
        c1, c2, s1, s2, BLOCK_KH, BLOCK_HALF, BACKWARD,
    )  # fmt: skip


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rope(q, k, cos, sin, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    batch, seq, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[2]
    # Broadcast cos/sin to (batch, seq, head_dim) as views: size-1 dims get stride 0.
    cos = _unit_last_stride(cos).expand(batch, seq, head_dim)
    sin = _unit_last_stride(sin).expand(batch, seq, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    n_tokens = batch * seq
    block_qh, block_kh = triton.next_power_of_2(n_q_heads), triton.next_power_of_2(n_k_heads)
    block_half = triton.next_power_of_2(half)
    block_t = rows_per_tile(max(block_qh, block_kh) * block_half, n_tokens)
    if q.numel() or k.numel():
        _rope_kernel[(triton.cdiv(n_tokens, block_t),)](
            q, *q.stride()[:3], k, *k.stride()[:3],
            q_out, *q_out.stride()[:3], k_out, *k_out.stride()[:3],
            cos, *cos.stride()[:2], sin, *sin.stride()[:2],
            n_tokens, seq, n_q_heads, n_k_heads, half,
            BLOCK_T=block_t, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half,
            BACKWARD=backward,
        )  # fmt: skip
    return q_out, k_out


def rope_forward(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q, k, cos, sin, backward=False)


def rope_backward(dq, dk, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(dq, dk, cos, sin, backward=True)


def _fake(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("kernels::rope_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_forward(q, k, cos, sin)


@torch.library.custom_op("kernels::rope_backward", mutates_args=())
def _backward_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_backward(dq, dk, cos, sin)


_forward_op.register_fake(_fake)
_backward_op.register_fake(_fake)
_forward = compile_safe(rope_forward, _forward_op)
_backward = compile_safe(rope_backward, _backward_op)


class RoPEFunction(torch.autograd.Function):
    """cos and sin are treated as constants (no gradient); `kernels.apply_rope` sends inputs
    whose cos/sin require grad to the reference instead."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _backward(dq, dk, cos, sin)
        return dq, dk, None, None


def apply_rope(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return RoPEFunction.apply(*distinct(q, k, cos, sin))
