import pytest
import torch

import kernels
from kernels import reference
from kernels.testing import DTYPES, assert_close, leaf, require_triton

require_triton()

# A single element, widths that are not powers of two, and more than one 1024-element block.
SHAPES = [(1, 1), (3, 5, 100), (2, 2100)]


def _check(gate, up, dtype, make=lambda t: t):
    g1, u1, g2, u2 = leaf(gate), leaf(up), leaf(gate), leaf(up)
    out = kernels.swiglu(make(g1), make(u1))
    out_ref = reference.swiglu(make(g2), make(u2))
    assert_close(out, out_ref, dtype)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (g1, u1), dout)
    want = torch.autograd.grad(out_ref, (g2, u2), dout)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    torch.manual_seed(0)
    gate, up = torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype)
    out = _check(gate, up, dtype)
    assert out.dtype == dtype and out.shape == gate.shape


def test_runs_the_triton_kernel():
    out = kernels.swiglu(leaf(torch.randn(4)), leaf(torch.randn(4)))
    assert type(out.grad_fn).__name__ == "SwiGLUFunctionBackward"


def test_halves_of_a_fused_projection():
    # gate and up as the two halves of one (tokens, 2 * hidden) matmul output: strided views.
    torch.manual_seed(1)
    fused = torch.randn(7, 2 * 90)
    g1, g2 = leaf(fused), leaf(fused)
    gate, up = g1.chunk(2, dim=-1)
    gate_ref, up_ref = g2.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    out, out_ref = kernels.swiglu(gate, up), reference.swiglu(gate_ref, up_ref)
    assert_close(out, out_ref, torch.float32)
    dout = torch.randn_like(out)
    (got,), (want,) = (
        torch.autograd.grad(out, (g1,), dout),
        torch.autograd.grad(out_ref, (g2,), dout),
    )
    assert_close(got, want, torch.float32)


def test_transposed_inputs():
    torch.manual_seed(2)
    _check(torch.randn(30, 6), torch.randn(30, 6), torch.float32, make=torch.t)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
def test_nan_and_inf_propagate_like_the_reference():
    gate = torch.tensor([[0.5, float("nan"), float("inf"), float("-inf"), 2.0, -30.0, 1.0, 0.0]])
    up = torch.tensor([[1.0, 1.0, 1.0, 1.0, float("nan"), 2.0, float("inf"), float("inf")]])
    out = _check(gate, up, torch.float32)
    assert torch.isnan(out[0, 1]) and torch.isinf(out[0, 2]) and torch.isfinite(out[0, 0])


def test_mismatched_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"kernels\.swiglu: gate \(2, 3\) and up \(3, 2\)"):
        kernels.swiglu(torch.randn(2, 3), torch.randn(3, 2))
    with pytest.raises(ValueError, match="one dtype"):
        kernels.swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float16))
