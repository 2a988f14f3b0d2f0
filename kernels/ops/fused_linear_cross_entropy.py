"""Linear layer + cross entropy without ever holding the full tokens x vocab logits.

Eager PyTorch materializes logits = hidden @ weight.T (tokens x vocab), an fp32 copy, the fp32
log-probabilities saved for backward and their gradient: at 8K tokens and a 128K vocabulary
that is ~4 GiB per fp32 tensor. Here the tokens are processed in chunks sized so a chunk's logits
are about as large as `hidden`: each chunk's logits are computed, turned into their gradient in
place by the cross entropy kernel, and immediately multiplied into grad_hidden and grad_weight.

For "mean" and "sum" the upstream gradient is a scalar, so the gradients are computed during the
forward pass and only scaled in backward (Liger-Kernel's approach: 3 matmuls, like eager). For
"none" every token has its own upstream weight, which grad_weight cannot take after the fact, so
the forward computes losses only and the backward recomputes each chunk's logits (4 matmuls).
"""

import torch
import triton

from kernels.ops.cross_entropy import launch_cross_entropy, scale_rows_safe
from kernels.ops.utils import compile_safe, distinct


def chunk_size(n_tokens: int, dim: int, vocab: int) -> int:
    """Tokens per chunk: chunk logits (chunk x vocab) about the size of hidden (tokens x dim)."""
    chunks = triton.cdiv(vocab, dim)
    return triton.next_power_of_2(max(1, triton.cdiv(n_tokens, chunks)))


def _chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    loss_rows: torch.Tensor,
    scale: torch.Tensor | None,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> None:
    """Fills loss_rows and, when `scale` is given, grad_hidden/grad_weight (either may be None)
    with the gradients of sum(loss_rows * scale). `scale` has one element or one per token."""
    n_tokens, dim = hidden.shape
    step = chunk_size(n_tokens, dim, weight.shape[0])
    for start in range(0, n_tokens, step):
        end = min(start + step, n_tokens)
        h = hidden[start:end]
        # In the inputs' dtype: the public function has already applied autocast's choice.
        with torch.autocast(hidden.device.type, enabled=False):
            logits = h @ weight.t()
        if scale is None:
            launch_cross_entropy(logits, target[start:end], loss_rows[start:end], ignore_index)
            continue
        # The gradient is written over the chunk's logits in place, then multiplied out.
        chunk_scale = scale if scale.numel() == 1 else scale[start:end]
        launch_cross_entropy(
            logits, target[start:end], loss_rows[start:end], ignore_index, logits, chunk_scale
        )
        with torch.autocast(hidden.device.type, enabled=False):
            if grad_hidden is not None:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(logits.t(), h)


def _flat(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden.reshape(-1, hidden.shape[-1]).contiguous(), target.reshape(-1).contiguous()


def _outputs(
    grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom ops cannot return None, nor one tensor twice: gradients not computed are empty."""
    grad_hidden = hidden.new_empty(0) if grad_hidden is None else grad_hidden.view(hidden.shape)
    return grad_hidden, hidden.new_empty(0) if grad_weight is None else grad_weight


def flce_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad_hidden, grad_weight). The gradients are those of the loss for a unit
    upstream gradient, computed only for "mean"/"sum" and when needed (else empty)."""
    h, t = _flat(hidden, target)
    weight = weight.contiguous()
    device = hidden.device
    loss_rows = torch.empty(t.shape[0], dtype=torch.float32, device=device)
    n_valid = (t != ignore_index).sum()
    grads_now = reduction != "none" and (need_grad_hidden or need_grad_weight)
    scale = None
    if grads_now:
        scale = torch.ones((), dtype=torch.float32, device=device)
        if reduction == "mean":
            scale = scale / n_valid.clamp(min=1)
    grad_hidden = torch.empty_like(h) if grads_now and need_grad_hidden else None
    grad_weight = torch.zeros_like(weight) if grads_now and need_grad_weight else None
    _chunked_pass(h, weight, t, ignore_index, loss_rows, scale, grad_hidden, grad_weight)

    if reduction == "none":
        loss = loss_rows.view(target.shape)
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / n_valid.clamp(min=1)
    return loss, *_outputs(grad_hidden, grad_weight, hidden)


def flce_backward_none(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients for reduction "none": recompute each chunk's logits, weight row i by
    grad_loss[i]."""
    h, t = _flat(hidden, target)
    weight = weight.contiguous()
    loss_rows = torch.empty(t.shape[0], dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(h) if need_grad_hidden else None
    grad_weight = torch.zeros_like(weight) if need_grad_weight else None
    scale = grad_loss.reshape(-1).float().contiguous()
    _chunked_pass(h, weight, t, ignore_index, loss_rows, scale, grad_hidden, grad_weight)
    return _outputs(grad_hidden, grad_weight, hidden)


@torch.library.custom_op("kernels::fused_linear_cross_entropy_forward", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flce_forward(
        hidden, weight, target, ignore_index, reduction, need_grad_hidden, need_grad_weight
    )


@_forward_op.register_fake
def _(hidden, weight, target, ignore_index, reduction, need_grad_hidden, need_grad_weight):
    loss = hidden.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32)
    grads_now = reduction != "none"
    grad_hidden = hidden.new_empty(hidden.shape if grads_now and need_grad_hidden else (0,))
    grad_weight = weight.new_empty(weight.shape if grads_now and need_grad_weight else (0,))
    return loss, grad_hidden, grad_weight


@torch.library.custom_op("kernels::fused_linear_cross_entropy_backward_none", mutates_args=())
def _backward_none_op(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flce_backward_none(
        grad_loss, hidden, weight, target, ignore_index, need_grad_hidden, need_grad_weight
    )


@_backward_none_op.register_fake
def _(grad_loss, hidden, weight, target, ignore_index, need_grad_hidden, need_grad_weight):
    grad_hidden = hidden.new_empty(hidden.shape if need_grad_hidden else (0,))
    grad_weight = weight.new_empty(weight.shape if need_grad_weight else (0,))
    return grad_hidden, grad_weight


_forward = compile_safe(flce_forward, _forward_op)
_backward_none = compile_safe(flce_backward_none, _backward_none_op)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, need_h, need_w):
        loss, grad_hidden, grad_weight = _forward(
            hidden, weight, target, ignore_index, reduction, need_h, need_w
        )
        ctx.reduction, ctx.ignore_index = reduction, ignore_index
        ctx.need_h, ctx.need_w = need_h, need_w
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target)
        else:
            ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.reduction == "none":
            hidden, weight, target = ctx.saved_tensors
            grad_hidden, grad_weight = _backward_none(
                grad_loss, hidden, weight, target, ctx.ignore_index, ctx.need_h, ctx.need_w
            )
        else:
            grad_hidden, grad_weight = ctx.saved_tensors
            scale = grad_loss.float()
            grad_hidden = scale_rows_safe(grad_hidden, scale) if ctx.need_h else grad_hidden
            grad_weight = scale_rows_safe(grad_weight, scale) if ctx.need_w else grad_weight
        return (
            grad_hidden if ctx.need_h else None,
            grad_weight if ctx.need_w else None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the projection is a matmul autocast would cast
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    grad_enabled = torch.is_grad_enabled()
    return FusedLinearCrossEntropyFunction.apply(
        *distinct(hidden, weight, target),
        ignore_index,
        reduction,
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
    )
