import pytest
import torch

import kernels
from kernels import reference
from kernels.ops.cross_entropy import MAX_BLOCK
from kernels.testing import DTYPES, assert_close, leaf, require_triton

require_triton()

REDUCTIONS = ("mean", "sum", "none")


def _check(logits, target, dtype, reduction="mean", ignore_index=-100, make=lambda t: t):
    l1, l2 = leaf(logits), leaf(logits)
    loss = kernels.cross_entropy(make(l1), target, ignore_index, reduction)
    loss_ref = reference.cross_entropy(make(l2), target, ignore_index, reduction)
    assert loss.dtype == torch.float32
    # The loss is fp32 from fp32 math either way; only the inputs were rounded.
    assert_close(loss, loss_ref, torch.float32)
    # A non-unit upstream gradient: a loss scaled for accumulation, or per-token weights.
    grad_loss = torch.rand_like(loss) + 0.5
    (got,) = torch.autograd.grad(loss, (l1,), grad_loss)
    (want,) = torch.autograd.grad(loss_ref, (l2,), grad_loss)
    assert_close(got, want, dtype)
    return loss, got


def _target(shape, vocab, ignored=()):
    target = torch.randint(0, vocab, shape)
    for i in ignored:
        target.view(-1)[i] = -100
    return target


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rows,vocab", [(1, 7), (6, 1000)])
def test_matches_reference(rows, vocab, reduction, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = _target((rows,), vocab, ignored=[1] if rows > 2 else [])
    loss, _ = _check(logits, target, dtype, reduction)
    assert loss.shape == ((rows,) if reduction == "none" else ())


@pytest.mark.parametrize(
    "reduction,dtype", [(r, torch.float32) for r in REDUCTIONS] + [("mean", torch.bfloat16)]
)
def test_vocabulary_wider_than_one_block(reduction, dtype):
    # Each row is streamed in blocks of MAX_BLOCK columns; the last block is partial.
    torch.manual_seed(6)
    vocab = MAX_BLOCK + 7233
    logits = (torch.randn(2, vocab) * 4).to(dtype)
    _check(logits, torch.tensor([vocab - 1, 5]), dtype, reduction)


def test_runs_the_triton_kernel():
    loss = kernels.cross_entropy(leaf(torch.randn(2, 5)), torch.tensor([1, 2]))
    assert type(loss.grad_fn).__name__ == "CrossEntropyFunctionBackward"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batch_and_sequence_dims(reduction):
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 33)
    loss, _ = _check(logits, _target((2, 5), 33, ignored=[0, 7]), torch.float32, reduction)
    assert loss.shape == ((2, 5) if reduction == "none" else ())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_loss_and_zero_gradient(reduction):
    logits = torch.randn(3, 11)
    loss, grad = _check(logits, torch.full((3,), -100), torch.float32, reduction)
    assert torch.all(loss == 0) and torch.all(grad == 0)


def test_custom_ignore_index_and_int32_targets():
    torch.manual_seed(2)
    target = torch.tensor([0, 3, 0, 5], dtype=torch.int32)
    _, grad = _check(torch.randn(4, 9), target, torch.float32, "mean", ignore_index=0)
    assert torch.all(grad[0] == 0) and torch.all(grad[2] == 0) and grad[1].abs().sum() > 0


def test_non_contiguous_logits():
    torch.manual_seed(3)
    target = _target((5,), 20, ignored=[2])
    # Shifted-logits slice (row stride 24 > vocab 20) and a transpose (column stride 5).
    _check(torch.randn(5, 24), target, torch.float32, make=lambda t: t[:, 2:22])
    _check(torch.randn(20, 5), target, torch.float32, make=torch.t)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("reduction", ("none", "mean"))
def test_nan_and_inf_propagate_like_the_reference(reduction):
    torch.manual_seed(4)
    logits = torch.randn(6, MAX_BLOCK + 7233)
    logits[0, 3] = float("nan")
    logits[1, 5] = float("inf")
    logits[2, :100] = float("-inf")  # masked vocabulary entries: still a finite loss
    logits[3, :] = float("-inf")  # an all -inf row: NaN like log_softmax
    logits[4, :MAX_BLOCK] = float("-inf")  # a whole first block at -inf, then finite values
    target = torch.tensor([1, 2, 150, 4, MAX_BLOCK + 5, 7])
    logits[5, 7] = float("-inf")  # the target itself at -inf: infinite loss
    loss, _ = _check(logits, target, torch.float32, reduction)
    if reduction == "none":
        assert loss[:2].isnan().all() and loss[3].isnan() and loss[5].isinf()
        assert torch.isfinite(loss[2]) and torch.isfinite(loss[4])


def test_no_grad_forward():
    torch.manual_seed(5)
    logits, target = torch.randn(3, 10), _target((3,), 10)
    with torch.no_grad():
        loss = kernels.cross_entropy(logits.requires_grad_(), target)
    assert_close(loss, reference.cross_entropy(logits.detach(), target), torch.float32)


def test_out_of_range_target_gives_nan_not_a_bad_read():
    loss = kernels.cross_entropy(torch.randn(2, 5), torch.tensor([1, 9]), reduction="none")
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1])


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"target has shape \(3,\), expected \(2,\)"):
        kernels.cross_entropy(torch.randn(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be one of"):
        kernels.cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="class indices"):
        kernels.cross_entropy(torch.randn(2, 5), torch.zeros(2))
