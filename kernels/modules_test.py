import math

import pytest
import torch

import kernels
from kernels import modules, reference
from kernels.testing import assert_close, leaf, require_triton

require_triton()


def test_rms_norm_module_learns_its_weight():
    torch.manual_seed(0)
    norm = modules.RMSNorm(12, eps=1e-5)
    x = torch.randn(3, 12)
    y = norm(x)
    assert_close(y, kernels.reference.rms_norm(x, norm.weight, 1e-5), torch.float32)
    y.sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.shape == (12,)


def test_swiglu_mlp_is_down_of_silu_gate_times_up():
    torch.manual_seed(1)
    mlp = modules.SwiGLUMLP(8, 20)
    x = torch.randn(2, 3, 8)
    gate, up = mlp.w1(x), mlp.w3(x)
    want = mlp.w2(torch.nn.functional.silu(gate) * up)
    assert_close(mlp(x), want, torch.float32)


def test_swiglu_mlp_parameter_names_and_order_are_llamas():
    # The trainer's checkpoints and optimizer state are keyed by these names, in this order.
    mlp = modules.SwiGLUMLP(8, 20)
    assert [(n, tuple(p.shape)) for n, p in mlp.named_parameters()] == [
        ("w1.weight", (20, 8)),
        ("w3.weight", (20, 8)),
        ("w2.weight", (8, 20)),
    ]


def test_rotary_embedding_restarts_at_each_packed_document():
    # Two documents packed in one row rotate exactly as each would alone from position 0.
    torch.manual_seed(2)
    rope = modules.RotaryEmbedding(8, max_len=4)
    q, k = torch.randn(1, 7, 2, 8), torch.randn(1, 7, 1, 8)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    q_out, k_out = rope(q, k, packed)
    for start, end in ((0, 4), (4, 7)):
        alone = torch.arange(end - start).unsqueeze(0)
        q_alone, k_alone = rope(q[:, start:end], k[:, start:end], alone)
        assert_close(q_out[:, start:end], q_alone, torch.float32)
        assert_close(k_out[:, start:end], k_alone, torch.float32)
    # Position 0 is the identity rotation; position 1 is not.
    assert_close(q_out[:, 0], q[:, 0], torch.float32)
    assert not torch.allclose(q_out[:, 1], q[:, 1])


@pytest.mark.parametrize("head_dim, base", [(128, 10000.0), (64, 500000.0)])
def test_rotary_tables_are_exact_to_fp32_rounding_at_long_positions(head_dim, base):
    # Against cos/sin computed per entry in float64 by `math`: every entry is within one unit
    # in fp32's last place below 1 (2^-24) of the exact value, also at position 8191, where
    # angles computed in fp32 are off by up to ~4e-4.
    rope = modules.RotaryEmbedding(head_dim, max_len=8192, base=base)
    positions = torch.tensor([[0, 1, 4097, 8190, 8191]])
    cos, sin = rope.cos_sin(positions)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (1, 5, head_dim)
    half = head_dim // 2
    angles = [
        [p * base ** (-2 * (i % half) / head_dim) for i in range(head_dim)]
        for p in positions[0].tolist()
    ]
    want_cos = torch.tensor([[[math.cos(a) for a in row] for row in angles]], dtype=torch.float64)
    want_sin = torch.tensor([[[math.sin(a) for a in row] for row in angles]], dtype=torch.float64)
    torch.testing.assert_close(cos.double(), want_cos, rtol=0, atol=2**-24)
    torch.testing.assert_close(sin.double(), want_sin, rtol=0, atol=2**-24)


def test_rotary_tables_are_not_in_the_state_dict():
    # Derived from the constructor's arguments: a model's checkpoint must not carry them.
    rope = modules.RotaryEmbedding(8, max_len=16)
    assert rope.state_dict() == {}
    assert {n for n, _ in rope.named_buffers()} == {"cos", "sin"}


def _swiglu_output(mlp: modules.SwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP's swiglu result, the input of its down projection."""
    seen = []
    handle = mlp.w2.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    mlp(x)
    handle.remove()
    return seen[0]


def test_layers_run_the_ops_they_are_given():
    # ops=kernels takes the Triton kernels (their autograd Functions); ops=reference never does.
    torch.manual_seed(4)
    x, q, k = torch.randn(2, 3, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    positions = torch.arange(3).repeat(2, 1)
    for ops, fused in ((kernels, True), (reference, False)):
        q_out, _ = modules.RotaryEmbedding(8, max_len=3, ops=ops)(leaf(q), k, positions)
        produced = {
            "RMSNormFunctionBackward": modules.RMSNorm(8, ops=ops)(x),
            "SwiGLUFunctionBackward": _swiglu_output(modules.SwiGLUMLP(8, 12, ops), x),
            "RoPEFunctionBackward": q_out,
            "CrossEntropyFunctionBackward": modules.CrossEntropyLoss(ops=ops)(
                leaf(x[0]), torch.tensor([0, 7, 3])
            ),
            "FusedLinearCrossEntropyFunctionBackward": modules.FusedLinearCrossEntropyLoss(ops=ops)(
                leaf(x[0]), torch.randn(5, 8), torch.tensor([0, 4, 3])
            ),
        }
        for function, out in produced.items():
            assert (type(out.grad_fn).__name__ == function) == fused, (ops.__name__, function)


def test_loss_modules_match_the_functions():
    torch.manual_seed(3)
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    target = torch.tensor([1, -1, 3, 10, -1, 0])
    for reduction in ("mean", "none"):
        ce = modules.CrossEntropyLoss(ignore_index=-1, reduction=reduction)
        flce = modules.FusedLinearCrossEntropyLoss(ignore_index=-1, reduction=reduction)
        want = kernels.reference.cross_entropy(hidden @ weight.t(), target, -1, reduction)
        assert_close(ce(hidden @ weight.t(), target), want, torch.float32)
        assert_close(flce(hidden, weight, target), want, torch.float32)
