"""SwiGLU activation: silu(gate) * up, one elementwise pass each way.

Eager PyTorch writes silu(gate) to memory, multiplies in a second kernel and keeps silu(gate)
for backward. Here the forward reads gate and up once and writes the product; the backward
recomputes the sigmoid from the saved inputs (cheap arithmetic instead of a saved tensor) and
writes both gradients in one pass.
"""

import torch
import triton
import triton.language as tl

from kernels.ops.utils import autotune_on_gpu, compile_safe, distinct

# The first config is the one used off-GPU (see autotune_on_gpu).
_CONFIGS = [
    triton.Config({"BLOCK_SIZE": 1024}, num_warps=4),
    triton.Config({"BLOCK_SIZE": 2048}, num_warps=8),
    triton.Config({"BLOCK_SIZE": 4096}, num_warps=8),
    triton.Config({"BLOCK_SIZE": 8192}, num_warps=16),
]


@autotune_on_gpu(_CONFIGS, key=["n_elements"])
@triton.jit
def _swiglu_fwd_kernel(GATE, UP, OUT, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


@autotune_on_gpu(_CONFIGS, key=["n_elements"])
@triton.jit
def _swiglu_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    # d silu(g) / dg = sig(g) * (1 + g * (1 - sig(g)))
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(DGATE + offsets, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offsets, (dout * silu).to(DUP.dtype.element_ty), mask=mask)


def _grid(n_elements: int):
    return lambda meta: (triton.cdiv(n_elements, meta["BLOCK_SIZE"]),)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[_grid(n)](gate, up, out, n)
    return out


def swiglu_backward(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[_grid(n)](dout, gate, up, dgate, dup, n)
    return dgate, dup


@torch.library.custom_op("kernels::swiglu_forward", mutates_args=())
def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(gate, up)


@_forward_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("kernels::swiglu_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(dout, gate, up)


@_backward_op.register_fake
def _(dout, gate, up):
    like = torch.contiguous_format
    return torch.empty_like(gate, memory_format=like), torch.empty_like(up, memory_format=like)


_forward = compile_safe(swiglu_forward, _forward_op)
_backward = compile_safe(swiglu_backward, _backward_op)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return _backward(dout, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(*distinct(gate, up))
