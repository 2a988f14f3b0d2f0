"""Training FLOPs per token, peak FLOP/s and MFU: the one source for the trainer and the planner.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B)::

    flops_per_token = 6·N + 12·L·H·Q·T

N: non-embedding parameters, L: layers, H: attention heads, Q: head dimension, T: sequence length.

Why 6·N. A weight matrix of shape (m, n) applied to one token is m·n multiply-adds, 2·m·n FLOPs:
2 FLOPs per parameter per token in the forward pass. The backward pass does twice that: one
matmul for the gradient with respect to the layer's input (to keep back-propagating) and one for
the gradient with respect to the weight. Forward + backward = 2 + 4 = 6 FLOPs per parameter per
token. N excludes the input embedding table, which is a lookup (no FLOPs); the output projection
onto the vocabulary is a real matmul and counts, even when its weight is tied to the embedding.

Why 12·L·H·Q·T. Attention has matmuls with no parameters. Per token, per head, the query is
dotted with T keys (Q·T multiply-adds = 2·Q·T FLOPs) and the T attention weights mix T values
(another 2·Q·T). Forward: 4·Q·T per head per layer, so 4·L·H·Q·T; times 3 for forward + backward
gives 12·L·H·Q·T. PaLM counts the full T×T score matrix even though a causal model needs only
half of it; kernels that skip the masked half do less work than counted, which is the convention
MFU is reported in everywhere, so numbers stay comparable.

Not counted: norms, activations, softmax, rotary, the loss (all O(d) per token, not O(d²)), and
recomputation (activation checkpointing redoes forward work; MFU counts only useful FLOPs, so
recomputation shows up as lower MFU, which is honest).

MFU = achieved FLOP/s / peak FLOP/s, achieved = tokens/s · flops_per_token. The peak comes from a
table of known accelerators (bf16/fp16 dense) or, for anything else (a CPU, an unlisted GPU, fp32
on a GPU), from a short matmul calibration: never a silent default. The basis is returned beside
the peak: "table:H100-SXM" or "measured".
"""

import math
import time

from trainer.sizing.accelerators import match_accelerator

# The table holds tensor-core rates for 16-bit inputs; other dtypes are measured.
_TABLE_DTYPES = {"bfloat16", "float16"}
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}

# (device, dtype) -> FLOP/s measured in this process; calibration runs once per pair.
_measured: dict[tuple[str, str], float] = {}


def flops_per_token(
    n_params_non_embedding: float, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training (forward + backward) FLOPs per token: 6·N + 12·L·H·Q·T (see module docstring)."""
    return 6.0 * n_params_non_embedding + 12.0 * n_layers * n_heads * head_dim * seq_len


def achieved_flops_per_second(tokens_per_second: float, flops_per_token: float) -> float:
    """Useful FLOP/s: tokens/s · FLOPs per token."""
    return tokens_per_second * flops_per_token


def mfu(tokens_per_second: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilization, a fraction in [0, 1] for sane inputs.

    tokens_per_second and peak must cover the same devices: per-device throughput with one
    device's peak, or global throughput with peak · world_size.
    """
    if peak <= 0:
        raise ValueError(f"peak must be positive, got {peak}")
    return achieved_flops_per_second(tokens_per_second, flops_per_token) / peak


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"dtype: unknown {dtype!r} (expected bf16, fp16 or fp32)")
    return _DTYPE_ALIASES[name]


def device_name(device) -> str:
    """The accelerator's marketing name for accelerator devices, else the device type ("cpu")."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":  # also ROCm, which reports e.g. "AMD Instinct MI300X"
        return torch.cuda.get_device_name(device)
    return device.type


def peak_flops_per_second(device, dtype) -> tuple[float, str]:
    """Peak dense FLOP/s of one device for matmuls in `dtype`, and its basis.

    device: a torch.device or a string torch.device accepts ("cuda:0", "cpu").
    Returns (flops_per_second, basis) with basis "table:<KEY>" for a known accelerator in bf16 or
    fp16, otherwise "measured" (a short matmul calibration, cached per process).
    """
    import torch

    device = torch.device(device)
    dtype_name = _dtype_name(dtype)
    if device.type == "cuda" and dtype_name in _TABLE_DTYPES:
        known = match_accelerator(device_name(device))
        if known is not None:
            return known.bf16_dense_flops, f"table:{known.key}"
    return measure_matmul_flops(device, dtype_name), "measured"


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        getattr(torch, device.type).synchronize()


def measure_matmul_flops(device, dtype, budget_s: float = 0.2) -> float:
    """Best FLOP/s of square matmuls on `device` in `dtype`, timed for about `budget_s`.

    The size doubles from 256 until one matmul takes a few milliseconds (so slow devices and
    slow dtypes stay within the budget), then the best of repeated runs is kept: the peak this
    device actually reaches, with this process's thread settings. Cached per (device, dtype).
    """
    import torch

    device = torch.device(device)
    dtype_name = _dtype_name(dtype)
    key = (str(device), dtype_name)
    if key in _measured:
        return _measured[key]
    torch_dtype = getattr(torch, dtype_name)
    max_n = 1024 if device.type == "cpu" else 8192
    n, elapsed = 128, 0.0
    while elapsed < 0.005 and n < max_n:
        n *= 2
        a = torch.randn(n, n, device=device).to(torch_dtype)
        b = torch.randn(n, n, device=device).to(torch_dtype)
        elapsed = _time_matmul(a, b, device)  # also the warm-up for the chosen size
    best = elapsed
    deadline = time.perf_counter() + budget_s
    for _ in range(50):
        if time.perf_counter() >= deadline:
            break
        best = min(best, _time_matmul(a, b, device))
    flops = 2.0 * n**3 / best
    if not (math.isfinite(flops) and flops > 0):
        raise RuntimeError(f"matmul calibration on {device} gave {flops} FLOP/s")
    _measured[key] = flops
    return flops


def _time_matmul(a, b, device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    a @ b
    _synchronize(device)
    return max(time.perf_counter() - start, 1e-9)


def vision_flops_per_image(
    encoder_matmul_params: float,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    patches: int,
    projector_matmul_params: float,
    image_tokens: int,
) -> float:
    """Training FLOPs of one image through a ViT encoder and its projector (#16, VLM).

    The encoder is a Transformer over `patches` tokens: `flops_per_token` at T = patches (its
    attention is bidirectional, so the full P x P score matrix PaLM counts is really computed),
    times the patches; the projector's MLP runs once per image token after pixel shuffle:
    6 FLOPs per weight per token. The LM's share of an image is `image_tokens` ordinary tokens
    (`flops_per_token`). Frozen parts still cost their forward and the backward to their input;
    counted as 6·N like the rest, so MFU in an align stage overstates useful work by at most
    the missing weight gradients (2·N of the frozen LM's 6·N).
    """
    encoder = flops_per_token(encoder_matmul_params, n_layers, n_heads, head_dim, patches)
    return encoder * patches + 6.0 * projector_matmul_params * image_tokens


def vlm_flops_per_row(vision_per_image: float, lm_flops_per_token: float, tokens: float) -> float:
    """Training FLOPs of one VLM row: its image through the encoder and projector
    (`vision_flops_per_image`), and the LM over its `tokens` (image tokens + text)."""
    return vision_per_image + lm_flops_per_token * tokens
