"""The dispatch rule: Triton (compiled or interpreted) where it can run, the reference elsewhere,
with identical results and errors. Environments that differ from this process (no interpreter,
no Triton at all) are checked in fresh interpreters, since both are fixed at import time."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import kernels

REPO_ROOT = pathlib.Path(kernels.__file__).parent.parent  # also the runfiles root under Bazel

# Runs every public op and prints the names of the autograd nodes they produced.
ALL_OPS = textwrap.dedent(
    """
    import torch, kernels
    from kernels import reference as ref
    torch.manual_seed(0)
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    q, k = torch.randn(1, 3, 2, 4, requires_grad=True), torch.randn(1, 3, 1, 4)
    cos = torch.randn(1, 3, 4)
    head, target = torch.randn(9, 8, requires_grad=True), torch.tensor([1, -100, 7])
    logits = x @ head.t()
    outputs = {
        "rms_norm": (kernels.rms_norm(x, w), ref.rms_norm(x, w)),
        "swiglu": (kernels.swiglu(x, x), ref.swiglu(x, x)),
        "apply_rope": (kernels.apply_rope(q, k, cos, cos)[0], ref.apply_rope(q, k, cos, cos)[0]),
        "cross_entropy": (kernels.cross_entropy(logits, target), ref.cross_entropy(logits, target)),
        "fused_linear_cross_entropy": (
            kernels.fused_linear_cross_entropy(x, head, target),
            ref.fused_linear_cross_entropy(x, head, target),
        ),
    }
    for name, (out, want) in outputs.items():
        assert torch.equal(out, want), name
    print("triton_available(cpu)", kernels.triton_available("cpu"))
    print(sorted({type(out.grad_fn).__name__ for out, _ in outputs.values()}))
    """
)


def _run(code: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_device_rule():
    assert kernels.triton_available("meta") is False
    assert kernels.triton_available("cuda") is torch.cuda.is_available()
    assert kernels.triton_available(torch.device("cpu")) is (
        os.environ.get("TRITON_INTERPRET") == "1"
    )


def test_cpu_without_the_interpreter_runs_the_reference():
    out = _run(ALL_OPS, interpret=False)
    assert "triton_available(cpu) False" in out
    assert "Function" not in out, out  # no kernels' autograd.Function in any graph


def test_without_triton_installed_everything_still_works():
    blocked = "import sys\nsys.modules['triton'] = None  # import triton now raises ImportError\n"
    out = _run(blocked + ALL_OPS, interpret=True)
    assert "triton_available(cpu) False" in out


def test_errors_are_the_same_on_both_paths():
    bad = "import torch, kernels\nkernels.swiglu(torch.randn(2, 3), torch.randn(3, 2))\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    messages = []
    for interpret in (False, True):
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        result = subprocess.run(
            [sys.executable, "-c", bad], env=env, capture_output=True, text=True, timeout=120
        )
        messages.append(result.stderr.strip().splitlines()[-1])
    assert messages[0] == messages[1]
    assert messages[0].startswith("ValueError: kernels.swiglu: gate (2, 3) and up (3, 2)")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_interpreter_runs_the_kernels():
    out = _run(ALL_OPS.replace("assert torch.equal(out, want), name", "pass"), interpret=True)
    assert "triton_available(cpu) True" in out
    for fn in ("RMSNorm", "SwiGLU", "RoPE", "CrossEntropy", "FusedLinearCrossEntropy"):
        assert f"{fn}FunctionBackward" in out, out
