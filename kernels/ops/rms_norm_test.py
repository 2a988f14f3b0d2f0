import pytest
import torch

import kernels
from kernels import reference
from kernels.testing import DTYPES, GRAD_SUM_SLACK, assert_close, leaf, require_triton

require_triton()

SHAPES = [(1, 8), (2, 3, 96), (4, 4096), (1, 5, 1000)]  # single row, odd widths, a real hidden


def _check(x, weight, dtype, grad_out=None, eps=1e-6):
    x1, w1, x2, w2 = leaf(x), leaf(weight), leaf(x), leaf(weight)
    y = kernels.rms_norm(x1, w1, eps)
    y_ref = reference.rms_norm(x2, w2, eps)
    assert_close(y, y_ref, dtype)
    grad_out = torch.randn_like(y) if grad_out is None else grad_out
    dx, dw = torch.autograd.grad(y, (x1, w1), grad_out)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x2, w2), grad_out)
    assert_close(dx, dx_ref, dtype)
    assert_close(dw, dw_ref, dtype, slack=GRAD_SUM_SLACK)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    y = _check(x, weight, dtype)
    assert y.dtype == dtype and y.shape == x.shape


def test_runs_the_triton_kernel():
    y = kernels.rms_norm(leaf(torch.randn(2, 16)), leaf(torch.ones(16)))
    assert type(y.grad_fn).__name__ == "RMSNormFunctionBackward"


def test_fp32_weight_with_bf16_input_keeps_each_dtype():
    torch.manual_seed(1)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    weight = torch.randn(40)
    x1, w1 = leaf(x), leaf(weight)
    y = kernels.rms_norm(x1, w1)
    assert y.dtype == torch.bfloat16
    assert_close(y, reference.rms_norm(x, weight), torch.bfloat16)
    dx, dw = torch.autograd.grad(y.float().sum(), (x1, w1))
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32


def test_non_contiguous_inputs():
    torch.manual_seed(2)
    weight = torch.randn(50)
    # Rows with a stride (every other row of a slice) and a last dim that is not unit-stride.
    for base, make in ((torch.randn(6, 2, 50), lambda t: t[::2, 1]), (torch.randn(50, 6), torch.t)):
        b1, b2, w1, w2 = leaf(base), leaf(base), leaf(weight), leaf(weight)
        x1, x2 = make(b1), make(b2)
        assert not x1.is_contiguous()
        y, y_ref = kernels.rms_norm(x1, w1), reference.rms_norm(x2, w2)
        assert_close(y, y_ref, torch.float32)
        g = torch.randn_like(y)
        for got, want in zip(
            torch.autograd.grad(y, (b1, w1), g),
            torch.autograd.grad(y_ref, (b2, w2), g),
            strict=True,
        ):
            assert_close(got, want, torch.float32)


def test_non_contiguous_upstream_gradient():
    torch.manual_seed(3)
    x, weight = torch.randn(4, 24), torch.randn(24)
    x1, w1, x2, w2 = leaf(x), leaf(weight), leaf(x), leaf(weight)
    # sum() hands backward an expanded (stride 0) gradient.
    got = torch.autograd.grad(kernels.rms_norm(x1, w1).sum(), (x1, w1))
    want = torch.autograd.grad(reference.rms_norm(x2, w2).sum(), (x2, w2))
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
def test_nan_and_inf_propagate_like_the_reference():
    torch.manual_seed(4)
    x = torch.randn(4, 33)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    x[3, 7] = float("-inf")
    y = _check(x, torch.randn(33), torch.float32)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


def test_eps_is_used():
    x = torch.full((1, 4), 1e-3)
    weight = torch.ones(4)
    assert_close(
        kernels.rms_norm(x, weight, eps=1.0), reference.rms_norm(x, weight, 1.0), torch.float32
    )
    assert kernels.rms_norm(x, weight, eps=1.0)[0, 0] < 0.01


def test_bad_weight_shape_names_the_argument():
    with pytest.raises(ValueError, match=r"kernels\.rms_norm: weight has shape \(5,\)"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(5))


def test_too_wide_row_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the fused limit"):
        kernels.rms_norm(torch.randn(1, 70000), torch.ones(70000))
