"""Grouped GEMM: rows of x in consecutive groups, group g multiplied by its own matrix w[g].

The mixture-of-experts layer sorts its tokens by expert, so expert g's tokens are one slice of
rows; `out[rows of g] = x[rows of g] @ w[g]`. A loop of G small matmuls launches G kernels and
pads nothing but wastes the GPU on small groups; one launch over tiles of every group keeps it
busy whatever the split (MegaBlocks' dropless argument).

Forward: a host-built schedule lists the BLOCK_M-row tiles of every group (group, first row,
group end); program (tile, column block) loops over K. A tile never straddles two groups, so
empty groups cost nothing and uneven groups waste at most one partial tile each.
Backward: dx is the same kernel with w transposed (strides, no copy); dw[g] = x[g rows]^T @
dout[g rows] is a second kernel with one program per (group, K block, N block) looping over the
group's rows, written as zeros for an empty group.

Accumulation is fp32. The interpreter's tl.dot mishandles bf16 inputs (NOTES.md), so there the
tiles are upcast to fp32 first; fp32 inputs use IEEE precision (not TF32), to stay comparable
with the reference.
"""

import torch
import triton
import triton.language as tl

from kernels.ops.utils import on_gpu


@triton.jit
def _grouped_mm_kernel(
    X, W, OUT, TILE_GROUP, TILE_ROW, TILE_END, N, K,
    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    group = tl.load(TILE_GROUP + tile).to(tl.int64)
    row_end = tl.load(TILE_END + tile).to(tl.int64)
    rows = tl.load(TILE_ROW + tile).to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < row_end, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            X + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            W + group * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out = OUT + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    X, DOUT, DW, GROUP_START, GROUP_END, K, N,
    stride_xm, stride_xk, stride_dm, stride_dn, stride_wg, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, col_mask = ks < K, cols < N
    start = tl.load(GROUP_START + group).to(tl.int64)
    end = tl.load(GROUP_END + group).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        xt = tl.load(
            X + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
            mask=k_mask[:, None] & row_mask[None, :],
            other=0.0,
        )
        d = tl.load(
            DOUT + rows[:, None] * stride_dm + cols[None, :] * stride_dn,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            xt, d = xt.to(tl.float32), d.to(tl.float32)
        acc += tl.dot(xt, d, input_precision=PRECISION)
    dw = DW + group * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _blocks() -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): GPU tiles; in the interpreter, where every program costs
    milliseconds, fewer and larger ones."""
    return (64, 128, 32) if on_gpu() else (32, 64, 64)


def _settings(dtype: torch.dtype) -> tuple[bool, str]:
    upcast = not on_gpu() or dtype == torch.float32
    return upcast, "ieee" if upcast else "tf32"


def _offsets(group_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = torch.tensor(group_sizes, dtype=torch.int64)
    ends = torch.cumsum(sizes, 0)
    return ends - sizes, ends


def grouped_mm_forward(x: torch.Tensor, w: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """x (M, K) @ w[g] (K, N) for the rows of each group g: out (M, N) in x's dtype."""
    M, K = x.shape
    N = w.shape[2]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    block_m, block_n, block_k = _blocks()
    starts, ends = _offsets(group_sizes)
    sizes = ends - starts
    tiles = (sizes + block_m - 1) // block_m
    tile_group = torch.repeat_interleave(torch.arange(len(group_sizes)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    within = torch.arange(int(tiles.sum())) - first_tile[tile_group]
    tile_row = starts[tile_group] + within * block_m
    tile_end = ends[tile_group]
    schedule = [t.to(x.device) for t in (tile_group, tile_row, tile_end)]
    upcast, precision = _settings(x.dtype)
    grid = (len(tile_group), triton.cdiv(N, block_n))
    _grouped_mm_kernel[grid](
        x, w, out, *schedule, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision,
    )  # fmt: skip
    return out


def grouped_mm_wgrad(
    x: torch.Tensor, dout: torch.Tensor, group_sizes: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """dw[g] = x[rows of g]^T @ dout[rows of g]: (G, K, N) in `dtype`, zeros for empty groups."""
    K, N, G = x.shape[1], dout.shape[1], len(group_sizes)
    dw = torch.empty(G, K, N, device=x.device, dtype=dtype)
    if G == 0:
        return dw
    block_m, block_n, block_k = _blocks()
    starts, ends = (t.to(x.device) for t in _offsets(group_sizes))
    upcast, precision = _settings(x.dtype)
    grid = (G, triton.cdiv(K, block_k), triton.cdiv(N, block_n))
    _grouped_wgrad_kernel[grid](
        x, dout, dw, starts, ends, K, N,
        x.stride(0), x.stride(1), dout.stride(0), dout.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, UPCAST=upcast, PRECISION=precision,
    )  # fmt: skip
    return dw


class GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_sizes):
        ctx.save_for_backward(x, w)
        ctx.group_sizes = group_sizes
        return grouped_mm_forward(x, w, group_sizes)

    @staticmethod
    def backward(ctx, dout):
        x, w = ctx.saved_tensors
        sizes = ctx.group_sizes
        dout = dout.contiguous()
        dx = grouped_mm_forward(dout, w.transpose(1, 2), sizes) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_wgrad(x, dout, sizes, w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    return GroupedGemmFunction.apply(x, w, list(group_sizes))
