import pytest
import torch

import kernels
from kernels import reference
from kernels.ops.fused_linear_cross_entropy import chunk_size
from kernels.testing import DTYPES, GRAD_SUM_SLACK, assert_close, leaf, require_triton

require_triton()

REDUCTIONS = ("mean", "sum", "none")


def _check(hidden, weight, target, dtype, reduction="mean", ignore_index=-100, wrt=(0, 1)):
    h1, w1, h2, w2 = leaf(hidden), leaf(weight), leaf(hidden), leaf(weight)
    for i, (a, b) in enumerate(((h1, h2), (w1, w2))):
        if i not in wrt:
            a.requires_grad_(False), b.requires_grad_(False)
    loss = kernels.fused_linear_cross_entropy(h1, w1, target, ignore_index, reduction)
    loss_ref = reference.fused_linear_cross_entropy(h2, w2, target, ignore_index, reduction)
    assert loss.dtype == torch.float32
    # Low-precision logits are rounded per chunk here and at once in the reference.
    assert_close(loss, loss_ref, dtype if dtype != torch.float32 else torch.float32, slack=4)
    grad_loss = torch.rand_like(loss) + 0.5
    inputs = [(h1, w1)[i] for i in wrt]
    got = torch.autograd.grad(loss, inputs, grad_loss)
    want = torch.autograd.grad(loss_ref, [(h2, w2)[i] for i in wrt], grad_loss)
    for a, b in zip(got, want, strict=True):
        # grad_weight sums over tokens; in fp16/bf16 it is also accumulated chunk by chunk.
        assert_close(a, b, dtype, slack=GRAD_SUM_SLACK)
    return loss, got


def _inputs(
    tokens, dim, vocab, dtype, ignored=()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(tokens, dim).to(dtype)
    weight = (torch.randn(vocab, dim) / dim**0.5).to(dtype)
    target = torch.randint(0, vocab, (tokens,))
    target[list(ignored)] = -100
    return hidden, weight, target


def test_odd_shapes_take_several_chunks():
    assert chunk_size(37, 32, 200) == 8  # 5 chunks, the last one partial
    assert chunk_size(1, 32, 200) == 1
    assert chunk_size(8192, 4096, 131072) == 256  # logits chunk = 256 x 128K, not 8K x 128K


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_reference(reduction, dtype):
    torch.manual_seed(0)
    hidden, weight, target = _inputs(37, 32, 200, dtype, ignored=[0, 5, 36])
    loss, _ = _check(hidden, weight, target, dtype, reduction)
    assert loss.shape == ((37,) if reduction == "none" else ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_vocabulary(dtype):
    # Llama-2's 32000 classes: not a multiple of the 32768-column block, one token per chunk.
    torch.manual_seed(9)
    hidden, weight, target = _inputs(6, 128, 32000, dtype, ignored=[2])
    assert chunk_size(6, 128, 32000) == 1
    _check(hidden, weight, target, dtype, "mean")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_single_token(reduction):
    torch.manual_seed(1)
    _check(*_inputs(1, 16, 50, torch.float32), torch.float32, reduction)


def test_runs_the_triton_kernel():
    hidden, weight, target = _inputs(3, 8, 10, torch.float32)
    loss = kernels.fused_linear_cross_entropy(leaf(hidden), weight, target)
    assert type(loss.grad_fn).__name__ == "FusedLinearCrossEntropyFunctionBackward"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batch_and_sequence_dims(reduction):
    torch.manual_seed(2)
    hidden = torch.randn(2, 9, 24)
    weight = torch.randn(70, 24) / 5
    target = torch.randint(0, 70, (2, 9))
    target[1, 3:] = -100
    loss, _ = _check(hidden, weight, target, torch.float32, reduction)
    assert loss.shape == ((2, 9) if reduction == "none" else ())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_loss_and_zero_gradients(reduction):
    hidden, weight, _ = _inputs(10, 16, 40, torch.float32)
    loss, grads = _check(hidden, weight, torch.full((10,), -100), torch.float32, reduction)
    assert torch.all(loss == 0) and all(torch.all(g == 0) for g in grads)


@pytest.mark.parametrize("reduction", ("mean", "none"))
@pytest.mark.parametrize("wrt", [(0,), (1,)])
def test_gradient_for_one_input_only(wrt, reduction):
    torch.manual_seed(3)
    _check(*_inputs(20, 16, 60, torch.float32, ignored=[4]), torch.float32, reduction, wrt=wrt)


def test_custom_ignore_index():
    torch.manual_seed(4)
    hidden, weight, target = _inputs(12, 16, 30, torch.float32)
    target[::3] = 29
    _check(hidden, weight, target, torch.float32, "mean", ignore_index=29)


def test_non_contiguous_inputs():
    torch.manual_seed(5)
    hidden, weight, target = _inputs(14, 20, 45, torch.float32, ignored=[1])
    h1, w1, h2, w2 = leaf(hidden.t()), leaf(weight.t()), leaf(hidden.t()), leaf(weight.t())
    loss = kernels.fused_linear_cross_entropy(h1.t(), w1.t(), target)
    loss_ref = reference.fused_linear_cross_entropy(h2.t(), w2.t(), target)
    assert_close(loss, loss_ref, torch.float32)
    for a, b in zip(
        torch.autograd.grad(loss, (h1, w1)), torch.autograd.grad(loss_ref, (h2, w2)), strict=True
    ):
        assert_close(a, b, torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
def test_nan_propagates_like_the_reference():
    torch.manual_seed(6)
    hidden, weight, target = _inputs(12, 16, 40, torch.float32)
    hidden[3, 2] = float("nan")
    loss, _ = _check(hidden, weight, target, torch.float32, "none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[:3]).all()


def test_no_grad_forward():
    torch.manual_seed(7)
    hidden, weight, target = _inputs(9, 16, 40, torch.float32, ignored=[2])
    with torch.no_grad():
        loss = kernels.fused_linear_cross_entropy(hidden.requires_grad_(), weight, target)
    want = reference.fused_linear_cross_entropy(hidden.detach(), weight, target)
    assert_close(loss, want, torch.float32)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(
        ValueError, match=r"weight \(5, 7\) must be \(vocab, dim\) with the same dim"
    ):
        kernels.fused_linear_cross_entropy(
            torch.randn(3, 8), torch.randn(5, 7), torch.zeros(3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="one dtype"):
        kernels.fused_linear_cross_entropy(
            torch.randn(3, 8), torch.randn(5, 8).half(), torch.zeros(3, dtype=torch.long)
        )


def test_autocast_runs_the_projection_in_the_autocast_dtype_like_the_reference():
    torch.manual_seed(8)
    hidden, weight, target = _inputs(10, 16, 40, torch.float32, ignored=[3])
    results = []
    for impl in (kernels, reference):
        h, w = leaf(hidden), leaf(weight)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = impl.fused_linear_cross_entropy(h, w, target)
        results.append((loss, *torch.autograd.grad(loss, (h, w))))
    for got, want in zip(*results, strict=True):
        assert got.dtype == torch.float32
        assert_close(got, want, torch.bfloat16, slack=GRAD_SUM_SLACK)
