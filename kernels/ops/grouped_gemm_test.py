import pytest
import torch

import kernels
from kernels import reference
from kernels.testing import DTYPES, GRAD_SUM_SLACK, assert_close, leaf, require_triton

require_triton()

# Uneven groups, an empty group first and in the middle, a group wider than one row tile, and
# widths (K, N) that are not multiples of the blocks.
CASES = [
    ([5], 8, 16),
    ([0, 7, 0, 40, 3], 24, 40),
    ([33, 1], 70, 20),
]


def _check(sizes, K, N, dtype):
    torch.manual_seed(sum(sizes) + K + N)
    x = torch.randn(sum(sizes), K, dtype=dtype)
    w = (torch.randn(len(sizes), K, N) / K**0.5).to(dtype)
    x1, w1, x2, w2 = leaf(x), leaf(w), leaf(x), leaf(w)
    out = kernels.grouped_gemm(x1, w1, sizes)
    want = reference.grouped_gemm(x2, w2, sizes)
    assert_close(out, want, dtype, slack=GRAD_SUM_SLACK)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (x1, w1), dout)
    expected = torch.autograd.grad(want, (x2, w2), dout)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, dtype, slack=GRAD_SUM_SLACK)
    return out, got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, K, N", CASES)
def test_matches_reference(sizes, K, N, dtype):
    out, (dx, dw) = _check(sizes, K, N, dtype)
    assert out.dtype == dtype and out.shape == (sum(sizes), N)
    assert dw.dtype == dtype and dw.shape == (len(sizes), K, N)


def test_empty_group_gets_a_zero_weight_gradient():
    _, (_, dw) = _check([0, 7, 0, 40, 3], 24, 40, torch.float32)
    assert not dw[0].any() and not dw[2].any() and dw[1].abs().sum() > 0


def test_no_rows_at_all():
    x, w = leaf(torch.randn(0, 8)), leaf(torch.randn(3, 8, 4))
    out = kernels.grouped_gemm(x, w, [0, 0, 0])
    assert out.shape == (0, 4)
    out.sum().backward()
    assert w.grad is not None and not w.grad.any()


def test_runs_the_triton_kernel():
    out = kernels.grouped_gemm(leaf(torch.randn(4, 16)), leaf(torch.randn(2, 16, 16)), [1, 3])
    assert type(out.grad_fn).__name__ == "GroupedGemmFunctionBackward"


def test_bad_input_names_the_argument():
    x, w = torch.randn(5, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="group_sizes sum to 4, x has 5 rows"):
        kernels.grouped_gemm(x, w, [1, 3])
    with pytest.raises(ValueError, match="group_sizes needs 2 non-negative sizes"):
        kernels.grouped_gemm(x, w, [5])
    with pytest.raises(ValueError, match=r"w \(2, 7, 4\) \(groups, K, N\)"):
        kernels.grouped_gemm(x, torch.randn(2, 7, 4), [2, 3])
    with pytest.raises(ValueError, match="x is torch.float32 and w torch.float16"):
        kernels.grouped_gemm(x, w.half(), [2, 3])
