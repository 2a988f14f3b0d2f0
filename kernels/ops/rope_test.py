import pytest
import torch

import kernels
from kernels import reference
from kernels.modules import RotaryEmbedding
from kernels.testing import DTYPES, assert_close, leaf, require_triton

require_triton()

# (batch, seq, heads, kv_heads, head_dim): one token and head; half = 5 (not a power of two);
# grouped-query attention with a real head_dim.
SHAPES = [(1, 1, 1, 1, 2), (2, 5, 4, 2, 10), (2, 3, 6, 2, 64)]


def _cos_sin(batch, seq, head_dim, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    # Per-token positions that restart, as packed documents do.
    positions = torch.arange(seq).repeat(batch, 1) % 3
    cos, sin = RotaryEmbedding(head_dim, max_len=3).cos_sin(positions)
    return cos.to(dtype), sin.to(dtype)


def _check(q, k, cos, sin, dtype, make=lambda t: t):
    q1, k1, q2, k2 = leaf(q), leaf(k), leaf(q), leaf(k)
    out = kernels.apply_rope(make(q1), make(k1), cos, sin)
    out_ref = reference.apply_rope(make(q2), make(k2), cos, sin)
    for a, b in zip(out, out_ref, strict=True):
        assert_close(a, b, dtype)
    douts = tuple(torch.randn_like(o) for o in out)
    got = torch.autograd.grad(out, (q1, k1), douts)
    want = torch.autograd.grad(out_ref, (q2, k2), douts)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    torch.manual_seed(0)
    batch, seq, heads, kv_heads, head_dim = shape
    q = torch.randn(batch, seq, heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, dtype=dtype)
    q_out, k_out = _check(q, k, *_cos_sin(batch, seq, head_dim), dtype)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape


def test_runs_the_triton_kernel():
    cos, sin = _cos_sin(1, 2, 4)
    q_out, _ = kernels.apply_rope(leaf(torch.randn(1, 2, 1, 4)), torch.randn(1, 2, 1, 4), cos, sin)
    assert type(q_out.grad_fn).__name__ == "RoPEFunctionBackward"


def test_general_cos_sin_halves():
    # The kernel must not assume cos = cat(f, f): arbitrary tables check each half separately.
    torch.manual_seed(1)
    q, k = torch.randn(2, 3, 2, 12), torch.randn(2, 3, 1, 12)
    _check(q, k, torch.randn(2, 3, 12), torch.randn(2, 3, 12), torch.float32)


def test_cos_sin_broadcast_over_batch_and_in_bf16():
    torch.manual_seed(2)
    q, k = torch.randn(3, 4, 2, 16), torch.randn(3, 4, 2, 16)
    cos, sin = _cos_sin(1, 4, 16, torch.bfloat16)
    _check(q, k, cos, sin, torch.float32)


def test_views_of_a_fused_qkv_projection():
    torch.manual_seed(3)
    batch, seq, heads, kv_heads, head_dim = 2, 3, 4, 2, 8
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(batch, seq, width)
    cos, sin = _cos_sin(batch, seq, head_dim)
    b1, b2 = leaf(qkv), leaf(qkv)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(batch, seq, heads, head_dim), k.view(batch, seq, kv_heads, head_dim)

    q1, k1 = split(b1)
    assert not q1.is_contiguous()
    out = kernels.apply_rope(q1, k1, cos, sin)
    out_ref = reference.apply_rope(*split(b2), cos, sin)
    for a, b in zip(out, out_ref, strict=True):
        assert_close(a, b, torch.float32)
    douts = tuple(torch.randn_like(o) for o in out)
    (got,), (want,) = (
        torch.autograd.grad(out, (b1,), douts),
        torch.autograd.grad(out_ref, (b2,), douts),
    )
    assert_close(got, want, torch.float32)


def test_transposed_head_layout():
    # (batch, heads, seq, dim) storage viewed as (batch, seq, heads, dim).
    torch.manual_seed(4)
    q, k = torch.randn(2, 3, 5, 6), torch.randn(2, 1, 5, 6)
    swap = lambda t: t.transpose(1, 2)  # noqa: E731
    _check(q, k, *_cos_sin(2, 5, 6), torch.float32, make=swap)


def test_learned_cos_sin_fall_back_to_the_reference_with_gradients():
    torch.manual_seed(5)
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    cos, sin = leaf(torch.randn(1, 2, 4)), leaf(torch.randn(1, 2, 4))
    q_out, k_out = kernels.apply_rope(q, k, cos, sin)
    dcos, dsin = torch.autograd.grad((q_out.sum() + k_out.sum()), (cos, sin))
    assert dcos.abs().sum() > 0 and dsin.abs().sum() > 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
def test_nan_and_inf_propagate_like_the_reference():
    q, k = torch.randn(1, 2, 2, 6), torch.randn(1, 2, 1, 6)
    q[0, 0, 1, 2] = float("nan")
    k[0, 1, 0, 4] = float("inf")
    q_out, k_out = _check(q, k, *_cos_sin(1, 2, 6), torch.float32)
    assert torch.isnan(q_out[0, 0, 1]).any() and torch.isfinite(q_out[0, 0, 0]).all()


def test_bad_shapes_are_clear_errors():
    cos, sin = _cos_sin(1, 2, 4)
    with pytest.raises(ValueError, match="must match q"):
        kernels.apply_rope(torch.randn(1, 2, 1, 4), torch.randn(1, 3, 1, 4), cos, sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        kernels.apply_rope(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3), cos, sin)
    with pytest.raises(ValueError, match=r"cos has shape \(1, 2, 4\), expected \(1, 2, 8\)"):
        kernels.apply_rope(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), cos, sin)
