"""Input validation shared by the Triton path and the reference, so both reject bad input with
the same message (naming the op and the argument) instead of failing deep inside a kernel."""

import torch

REDUCTIONS = ("mean", "sum", "none")


def _fail(op: str, message: str) -> None:
    raise ValueError(f"kernels.{op}: {message}")


def _float(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        _fail(op, f"{name} must be a floating-point tensor, got {t.dtype}")


def _same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        _fail(op, f"all inputs must be on one device, got {devices}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    _float("rms_norm", "x", x)
    _float("rms_norm", "weight", weight)
    _same_device("rms_norm", x=x, weight=weight)
    if x.dim() == 0 or weight.shape != x.shape[-1:]:
        _fail(
            "rms_norm",
            f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1] if x.dim() else '?'},)"
            f" = the last dimension of x {tuple(x.shape)}",
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> None:
    _float("swiglu", "gate", gate)
    _same_device("swiglu", gate=gate, up=up)
    if gate.shape != up.shape:
        _fail("swiglu", f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dtype != up.dtype:
        _fail("swiglu", f"gate ({gate.dtype}) and up ({up.dtype}) must have one dtype")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    op = "apply_rope"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _float(op, name, t)
    _same_device(op, q=q, k=k, cos=cos, sin=sin)
    if q.dim() != 4 or k.dim() != 4:
        _fail(
            op, f"q {tuple(q.shape)} and k {tuple(k.shape)} must be (batch, seq, heads, head_dim)"
        )
    batch, seq, _, head_dim = q.shape
    if k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
        _fail(op, f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, seq and head_dim")
    if head_dim % 2:
        _fail(op, f"head_dim must be even for rotate-half, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or any(
            have not in (1, want)
            for have, want in zip(t.shape, (batch, seq, head_dim), strict=True)
        ):
            _fail(op, f"{name} has shape {tuple(t.shape)}, expected ({batch}, {seq}, {head_dim})")


def _target(op: str, target: torch.Tensor, rows_shape: torch.Size) -> None:
    if target.dtype not in (torch.int64, torch.int32):
        _fail(op, f"target must be int64 or int32 class indices, got {target.dtype}")
    if target.shape != rows_shape:
        _fail(op, f"target has shape {tuple(target.shape)}, expected {tuple(rows_shape)}")


def _reduction(op: str, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        _fail(op, f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> None:
    op = "cross_entropy"
    _float(op, "logits", logits)
    _same_device(op, logits=logits, target=target)
    if logits.dim() < 2:
        _fail(op, f"logits must be (..., vocab), got shape {tuple(logits.shape)}")
    _target(op, target, logits.shape[:-1])
    _reduction(op, reduction)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, reduction: str
) -> None:
    op = "fused_linear_cross_entropy"
    _float(op, "hidden", hidden)
    _float(op, "weight", weight)
    _same_device(op, hidden=hidden, weight=weight, target=target)
    if hidden.dim() < 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        _fail(
            op,
            f"hidden {tuple(hidden.shape)} must be (..., dim) and weight {tuple(weight.shape)}"
            " must be (vocab, dim) with the same dim",
        )
    if hidden.dtype != weight.dtype:
        _fail(op, f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype")
    _target(op, target, hidden.shape[:-1])
    _reduction(op, reduction)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: list[int]) -> None:
    _float("grouped_gemm", "x", x)
    _float("grouped_gemm", "w", w)
    _same_device("grouped_gemm", x=x, w=w)
    if x.dim() != 2 or w.dim() != 3 or w.shape[1] != x.shape[1]:
        _fail(
            "grouped_gemm",
            f"x {tuple(x.shape)} must be (M, K) and w {tuple(w.shape)} (groups, K, N)",
        )
    if x.dtype != w.dtype:
        _fail("grouped_gemm", f"x is {x.dtype} and w {w.dtype}: cast one (autocast does not)")
    if len(group_sizes) != w.shape[0] or any(n < 0 for n in group_sizes):
        _fail(
            "grouped_gemm",
            f"group_sizes needs {w.shape[0]} non-negative sizes, got {list(group_sizes)[:8]}",
        )
    if sum(group_sizes) != x.shape[0]:
        _fail("grouped_gemm", f"group_sizes sum to {sum(group_sizes)}, x has {x.shape[0]} rows")
