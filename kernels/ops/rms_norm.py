"""RMSNorm with weight: y = x / sqrt(mean(x^2) + eps) * w, fused into one pass per row.

Eager PyTorch runs ~5 kernels (square, mean, add, rsqrt, two multiplies) and saves their fp32
intermediates for backward. Here the forward reads x once, writes y and one fp32 reciprocal RMS
per row (saved for backward instead of recomputing it); the backward reads dy, x and that rstd
once, writes dx, and reduces dw in fp32 per program before one small sum.
"""

import torch
import triton
import triton.language as tl

from kernels.ops.utils import (
    MAX_FUSED_SIZE,
    compile_safe,
    distinct,
    program_count,
    row_settings,
    rows_per_tile,
)


@triton.jit
def _rms_norm_fwd_kernel(
    X, stride_x, Y, stride_y, W, RSTD, n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_SIZE)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, stride_dy, X, stride_x, W, RSTD, DX, stride_dx, DW_PARTIAL,
    n_rows, n_cols, rows_per_program, BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    # int64 bounds make the row indices int64, so row * stride cannot overflow on large inputs.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for start in range(row_start, row_end, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
        # y = x * rstd * w, rstd = (mean(x^2) + eps)^-1/2  =>
        # dx = rstd * (dy * w) - x * rstd^3 * mean(dy * w * x)
        g = dy * w[None, :]
        mean_gx = tl.sum(g * x, axis=1)[:, None] / n_cols
        dx = rstd * g - x * (rstd * rstd * rstd) * mean_gx
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
        dw += tl.sum(dy * x * rstd, axis=0)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A (rows, n_cols) view with unit column stride (rows may be strided), copying if needed."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _settings(n_cols: int) -> tuple[int, int]:
    block, num_warps = row_settings(n_cols)
    if block > MAX_FUSED_SIZE:
        raise ValueError(
            f"kernels.rms_norm: width {n_cols} exceeds the fused limit {MAX_FUSED_SIZE}"
        )
    return block, num_warps


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype) and the fp32 reciprocal RMS of each row."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    block, num_warps = _settings(n_cols)
    rows = rows_per_tile(block, n_rows)
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y.view(x.shape), rstd
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x2, x2.stride(0), y, y.stride(0), weight.contiguous(), rstd, n_rows, n_cols, eps,
        BLOCK_ROWS=rows, BLOCK_SIZE=block, num_warps=num_warps,
    )  # fmt: skip
    return y.view(x.shape), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns dx (x's shape and dtype) and dweight (weight's dtype)."""
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    block, num_warps = _settings(n_cols)
    programs = program_count(n_rows, x.device)
    rows_per_program = triton.cdiv(n_rows, programs)
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, dy2.stride(0), x2, x2.stride(0), weight.contiguous(), rstd, dx, dx.stride(0),
        dw_partial, n_rows, n_cols, rows_per_program,
        BLOCK_ROWS=rows_per_tile(block, rows_per_program), BLOCK_SIZE=block, num_warps=num_warps,
    )  # fmt: skip
    return dx.view(x.shape), dw_partial.sum(dim=0).to(weight.dtype)


@torch.library.custom_op("kernels::rms_norm_forward", mutates_args=())
def _forward_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_forward(x, weight, eps)


@_forward_op.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        rows, dtype=torch.float32
    )


@torch.library.custom_op("kernels::rms_norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, x, weight, rstd)


@_backward_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


_forward = compile_safe(rms_norm_forward, _forward_op)
_backward = compile_safe(rms_norm_backward, _backward_op)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _backward(dy, x, weight, rstd)
        return dx, dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return RMSNormFunction.apply(*distinct(x, weight), eps)
