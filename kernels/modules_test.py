import torch

import kernels
from kernels import modules
from kernels.testing import assert_close, require_triton_interpreter

require_triton_interpreter()


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
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    want = mlp.down_proj(torch.nn.functional.silu(gate) * up)
    assert_close(mlp(x), want, torch.float32)


def test_rotary_embedding_restarts_at_each_packed_document():
    # Two documents packed in one row rotate exactly as each would alone from position 0.
    torch.manual_seed(2)
    rope = modules.RotaryEmbedding(8)
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
