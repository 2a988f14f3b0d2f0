"""torch.library.opcheck on every custom op the kernels register: schema, fake (shape-only)
implementation against the real one, and AOT dispatch. These ops are what torch.compile sees."""

import pytest
import torch

import kernels  # noqa: F401  (registers the custom ops)
from kernels.testing import require_triton

require_triton()

torch.manual_seed(0)
_X, _W = torch.randn(3, 10), torch.randn(10)
_Q, _K, _COS = torch.randn(1, 3, 2, 6), torch.randn(1, 3, 1, 6), torch.randn(1, 3, 6)
_LOGITS, _TARGET = torch.randn(4, 9), torch.tensor([1, -100, 3, 8])
_HIDDEN, _LM_HEAD = torch.randn(4, 8), torch.randn(9, 8)

_FLCE = "fused_linear_cross_entropy"
CASES = [  # (op name, arguments)
    ("rms_norm_forward", (_X, _W, 1e-6)),
    ("rms_norm_backward", (_X, _X, _W, torch.rand(3) + 0.5)),
    ("swiglu_forward", (_X, _X)),
    ("swiglu_backward", (_X, _X, _X)),
    ("rope_forward", (_Q, _K, _COS, _COS)),
    ("rope_backward", (_Q, _K, _COS, _COS)),
    ("cross_entropy_forward", (_LOGITS, _TARGET, -100, "mean", True)),
    ("cross_entropy_forward", (_LOGITS, _TARGET, -100, "none", False)),
    ("scale_rows", (_LOGITS, torch.rand(4))),
    (f"{_FLCE}_forward", (_HIDDEN, _LM_HEAD, _TARGET, -100, "sum", True, True)),
    (f"{_FLCE}_forward", (_HIDDEN, _LM_HEAD, _TARGET, -100, "none", False, False)),
    (f"{_FLCE}_backward_none", (torch.rand(4), _HIDDEN, _LM_HEAD, _TARGET, -100, True, False)),
]


@pytest.mark.parametrize("name,args", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.kernels, name), args)
