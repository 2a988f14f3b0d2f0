"""Which implementation an op runs: compiled Triton, interpreted Triton, or the PyTorch reference.

- CUDA tensors (and ROCm, which PyTorch also calls "cuda") run the compiled Triton kernels.
- CPU tensors run the same Triton kernels in Triton's interpreter when TRITON_INTERPRET=1 was set
  before `kernels` was imported: that is how CI checks the kernels without a GPU.
- Everything else (CPU without the interpreter, other devices, no Triton installed) runs
  `kernels.reference`, which has the same signatures and semantics.
"""

import importlib
import os

import torch

# Triton reads TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when `kernels.ops` is
# imported, not at launch time. Reading it once here keeps the dispatch rule consistent with how
# the kernels were actually built, even if the variable changes later.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _import_triton() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:  # not installed (e.g. macOS): every op uses the reference
        return False
    return True


TRITON_IMPORTABLE = _import_triton()


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels (compiled or interpreted) run for tensors on `device`."""
    device = torch.device(device)
    if not TRITON_IMPORTABLE:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        return INTERPRET
    return False


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op whose inputs are `tensors` takes the Triton path (decided by the first one;
    `kernels.checks` has already verified they share a device)."""
    return triton_available(tensors[0].device)
