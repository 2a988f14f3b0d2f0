"""Helpers for the kernel tests: dtype-fit tolerances, and a guard that Triton really runs."""

import os

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


# Where the kernel tests run: "cpu", in Triton's interpreter (TRITON_INTERPRET=1, as the Bazel
# targets set it), or "cuda", compiled (tools/gpu/verify.sh sets KITCHEN_KERNEL_TEST_DEVICE).
TEST_DEVICE = torch.device(os.environ.get("KITCHEN_KERNEL_TEST_DEVICE", "cpu"))


def require_triton() -> None:
    """Fails loudly when the Triton path is off on the test device, so a kernel test never
    compares the reference with itself; makes that device the default for new tensors."""
    if not kernels.triton_available(TEST_DEVICE):
        how = (
            "set TRITON_INTERPRET=1 before Python starts (the Bazel targets set it)"
            if TEST_DEVICE.type == "cpu"
            else "this machine has no working CUDA Triton"
        )
        raise RuntimeError(f"kernel tests need Triton on {TEST_DEVICE}: {how}")
    if TEST_DEVICE.type != "cpu":  # a default-device mode slows every torch call: only if needed
        torch.set_default_device(TEST_DEVICE)


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
