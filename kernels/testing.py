"""Helpers for the kernel tests: dtype-fit tolerances and an interpreter guard."""

import torch

import kernels

# Kernels compute in fp32 like the references, so results differ only by the final rounding to
# the output dtype (the interpreter truncates bf16 instead of rounding: up to 1 ulp, 2^-7) plus
# fp32 reassociation. Gradients that sum over many rows get GRAD_SUM_SLACK times more room.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
GRAD_SUM_SLACK = 4

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def require_triton_interpreter() -> None:
    """Fails loudly when the Triton path is off, so a kernel test never compares the reference
    with itself."""
    if not kernels.triton_available("cpu"):
        raise RuntimeError(
            "kernel tests need Triton's interpreter: set TRITON_INTERPRET=1 before Python starts "
            "(the Bazel targets set it)"
        )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, slack: float = 1.0
) -> None:
    """NaN and inf must appear in the same places; finite values within the dtype's tolerance."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        atol=tol["atol"] * slack,
        rtol=tol["rtol"] * slack,
        equal_nan=True,
    )


def grads(
    output: torch.Tensor | tuple[torch.Tensor, ...],
    inputs: tuple[torch.Tensor, ...],
    grad_output: torch.Tensor | tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(output, inputs, grad_output)


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf copy that requires grad, so kernel and reference get separate graphs."""
    return t.detach().clone().requires_grad_(True)
