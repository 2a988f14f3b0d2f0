"""The references against PyTorch's own ops and independent formulas: they are the oracle every
kernel test compares with, so they are checked on their own first."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import reference


def test_rms_norm_matches_torch():
    torch.manual_seed(0)
    x, weight = torch.randn(4, 7, 24), torch.randn(24)
    want = F.rms_norm(x, (24,), weight, eps=1e-6)
    torch.testing.assert_close(reference.rms_norm(x, weight), want)


def test_rms_norm_keeps_low_precision_dtype_but_computes_in_fp32():
    x = torch.full((1, 4096), 3.0, dtype=torch.bfloat16)
    y = reference.rms_norm(x, torch.ones(4096, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert torch.all(y == 1.0)  # the bf16 sum of 4096 squares would already be off


def test_swiglu_matches_torch():
    torch.manual_seed(1)
    gate, up = torch.randn(3, 50), torch.randn(3, 50)
    torch.testing.assert_close(reference.swiglu(gate, up), F.silu(gate) * up)


def test_apply_rope_is_a_rotation_of_each_pair():
    # Rotate-half pairs element i with i + D/2: as a complex number it is multiplied by e^(i*angle).
    torch.manual_seed(2)
    batch, seq, heads, head_dim = 2, 5, 3, 8
    q, k = torch.randn(batch, seq, heads, head_dim), torch.randn(batch, seq, 1, head_dim)
    angles = torch.randn(batch, seq, head_dim // 2)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)
    q_out, k_out = reference.apply_rope(q, k, cos, sin)
    rotation = torch.polar(torch.ones_like(angles), angles).unsqueeze(2)
    for x, out in ((q, q_out), (k, k_out)):
        half = head_dim // 2
        z = torch.complex(x[..., :half], x[..., half:]) * rotation
        torch.testing.assert_close(out, torch.cat((z.real, z.imag), dim=-1))
        torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch(reduction):
    torch.manual_seed(3)
    logits, target = torch.randn(6, 11), torch.tensor([0, 3, -100, 10, 4, -100])
    want = F.cross_entropy(logits, target, reduction=reduction)
    torch.testing.assert_close(reference.cross_entropy(logits, target, reduction=reduction), want)


def test_cross_entropy_over_batch_and_sequence():
    torch.manual_seed(4)
    logits, target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    want = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    torch.testing.assert_close(reference.cross_entropy(logits, target, reduction="none"), want)


def test_all_ignored_mean_is_zero_where_torch_gives_nan():
    logits = torch.randn(3, 5, requires_grad=True)
    target = torch.full((3,), -100)
    assert math.isnan(F.cross_entropy(logits, target).item())
    loss = reference.cross_entropy(logits, target)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logits.grad == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_linear_cross_entropy_is_cross_entropy_of_the_projection(reduction):
    torch.manual_seed(5)
    hidden, weight = torch.randn(7, 4), torch.randn(9, 4)
    target = torch.tensor([1, 2, 3, -100, 5, 6, 8])
    want = F.cross_entropy(hidden @ weight.t(), target, reduction=reduction)
    got = reference.fused_linear_cross_entropy(hidden, weight, target, reduction=reduction)
    torch.testing.assert_close(got, want)
