"""Cross entropy with the logits gradient computed during the forward pass.

Eager PyTorch (logits upcast to fp32, log_softmax, nll_loss) keeps a full fp32 log-probability
tensor for backward and writes several more tokens x vocab tensors. Here each program (one row,
or a few when the vocabulary is small) makes two passes over the logits: an online max/sum-exp
(the log-sum-exp), then grad = (softmax - onehot(target)) * scale written straight into a buffer
of the logits' dtype. Nothing tokens x vocab in fp32 is ever stored, and the backward is a single
scaling pass. The same kernel, writing the gradient over the logits in place, is the core of the
fused linear cross entropy.
"""

import torch
import triton
import triton.language as tl

from kernels.ops.utils import (
    MAX_FUSED_SIZE,
    compile_safe,
    elementwise_block,
    row_settings,
    rows_per_tile,
)

# Vocabulary columns per loop iteration: the row is streamed, so any vocabulary size works.
MAX_BLOCK = MAX_FUSED_SIZE // 2


@triton.jit
def cross_entropy_kernel(
    LOGITS, stride_logits, GRAD, stride_grad, TARGET, LOSS, SCALE, stride_scale,
    n_rows, n_cols, ignore_index,
    BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
):  # fmt: skip
    """LOSS[row] = logsumexp(row) - row[target]; GRAD[row] = (softmax - onehot) * SCALE[row].

    Rows whose target is ignore_index get loss 0 and gradient 0. GRAD may be LOGITS itself (each
    block is read before it is overwritten). SCALE is read at row * stride_scale: stride 0 for
    one scale (1/n_valid for "mean"), 1 for a scale per row. A target outside [0, n_cols) gives a
    NaN loss rather than an out-of-bounds read.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    target = tl.load(TARGET + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    active = row_mask & (target != ignore_index)
    logits_rows = LOGITS + rows[:, None] * stride_logits

    # Pass 1: online log-sum-exp. A block (or a row prefix) that is all -inf has max -inf;
    # shifting by 0 instead keeps exp() at 0 rather than NaN from (-inf) - (-inf).
    m = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    d = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        mask = active[:, None] & (cols < n_cols)[None, :]
        x = tl.load(logits_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
    # Ignored rows get lse 0 so that no inf/NaN is computed (and then masked) for them.
    lse = tl.where(
        active, tl.where(m == float("-inf"), 0.0, m) + tl.log(tl.where(active, d, 1.0)), 0.0
    )

    in_range = (target >= 0) & (target < n_cols)
    x_target = tl.load(LOGITS + rows * stride_logits + target, mask=active & in_range, other=0.0)
    loss = tl.where(in_range, lse - x_target.to(tl.float32), float("nan"))
    tl.store(LOSS + rows, tl.where(active, loss, 0.0), mask=row_mask)

    # Pass 2: the gradient, already scaled for the reduction.
    if COMPUTE_GRAD:
        scale = tl.load(SCALE + rows * stride_scale, mask=active, other=0.0).to(tl.float32)
        grad_rows = GRAD + rows[:, None] * stride_grad
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            col_mask = (cols < n_cols)[None, :]
            x = tl.load(logits_rows + cols[None, :], mask=active[:, None] & col_mask, other=0.0)
            p = tl.exp(x.to(tl.float32) - lse[:, None])
            g = tl.where(cols[None, :] == target[:, None], p - 1.0, p) * scale[:, None]
            g = tl.where(active[:, None], g, 0.0)  # ignored rows: zeros, without reading them
            store_mask = row_mask[:, None] & col_mask
            tl.store(grad_rows + cols[None, :], g.to(GRAD.dtype.element_ty), mask=store_mask)


@triton.jit
def _scale_rows_kernel(IN, OUT, SCALE, stride_scale, n_elements, n_cols, BLOCK_SIZE: tl.constexpr):
    """OUT = IN * SCALE[row * stride_scale] over a contiguous (rows, n_cols) tensor, in fp32."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    scale = tl.load(SCALE + (offsets // n_cols) * stride_scale, mask=mask, other=0.0)
    x = tl.load(IN + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, (x * scale.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def launch_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    ignore_index: int,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """Runs the kernel over the rows of a 2-D `logits` with unit column stride. With `grad`
    (which may be `logits` itself) and `scale` (one element, or one per row), also writes the
    scaled gradient."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block, num_warps = row_settings(min(n_cols, MAX_BLOCK))
    rows = rows_per_tile(block, n_rows)
    compute_grad = grad is not None
    if grad is None:  # placeholders: the kernel reads neither without COMPUTE_GRAD
        grad, scale = logits, loss
    elif scale is None:
        raise ValueError("launch_cross_entropy: `grad` needs a `scale`")
    cross_entropy_kernel[(triton.cdiv(n_rows, rows),)](
        logits, logits.stride(0), grad, grad.stride(0), target, loss,
        scale, 1 if scale.numel() > 1 else 0, n_rows, n_cols, ignore_index,
        BLOCK_ROWS=rows, BLOCK_SIZE=block, COMPUTE_GRAD=compute_grad, num_warps=num_warps,
    )  # fmt: skip


def scale_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale into a new tensor of x's dtype: one scale, or one per row of x viewed as
    (scale.numel(), -1). Multiplies in fp32 (a torch multiply would promote bf16 to fp32 and
    need a second, full-size tensor)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        n_cols = n // scale.numel() if scale.numel() > 1 else n
        block = elementwise_block(n)
        _scale_rows_kernel[(triton.cdiv(n, block),)](
            x, out, scale.contiguous(), 1 if scale.numel() > 1 else 0, n, n_cols,
            BLOCK_SIZE=block, num_warps=8,
        )  # fmt: skip
    return out


def _rows(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits.reshape(-1, logits.shape[-1]), target.reshape(-1).contiguous()


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the loss (fp32; target's shape for "none", else a scalar) and the gradient of
    that loss with respect to logits (logits' dtype and shape; empty unless `compute_grad`)."""
    logits2, target1 = _rows(logits, target)
    n_rows = logits2.shape[0]
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    n_valid = (target1 != ignore_index).sum()
    if reduction == "mean":
        scale = 1.0 / n_valid.clamp(min=1).to(torch.float32)
    else:
        scale = torch.ones((), dtype=torch.float32, device=logits.device)
    grad = torch.empty(
        logits2.shape if compute_grad else (0,), dtype=logits.dtype, device=logits.device
    )
    launch_cross_entropy(
        logits2, target1, loss_rows, ignore_index, grad if compute_grad else None, scale
    )
    if compute_grad:
        grad = grad.view(logits.shape)
    if reduction == "none":
        return loss_rows.view(target.shape), grad
    loss = loss_rows.sum()
    if reduction == "mean":
        loss = loss * scale
    return loss, grad


@torch.library.custom_op("kernels::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_forward(logits, target, ignore_index, reduction, compute_grad)


@_forward_op.register_fake
def _(logits, target, ignore_index, reduction, compute_grad):
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32)
    grad = logits.new_empty(logits.shape if compute_grad else (0,))
    return loss, grad


@torch.library.custom_op("kernels::scale_rows", mutates_args=())
def _scale_rows_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scale_rows(x, scale)


@_scale_rows_op.register_fake
def _(x, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_forward = compile_safe(cross_entropy_forward, _forward_op)
scale_rows_safe = compile_safe(scale_rows, _scale_rows_op)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, compute_grad):
        loss, grad = _forward(logits, target, ignore_index, reduction, compute_grad)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        # The saved gradient is for a unit upstream gradient; "none" scales each row.
        return scale_rows_safe(grad, grad_loss.float()), None, None, None, None


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    return CrossEntropyFunction.apply(logits, target, ignore_index, reduction, compute_grad)
