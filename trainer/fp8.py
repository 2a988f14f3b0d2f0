"""fp8 training (`train.dtype: fp8`): the blocks' Linear layers compute their matmuls in float8.

The design is torchao's float8 training with tensorwise dynamic scaling, written here on
`torch._scaled_mm` (torchao is not a dependency):

- every forward, the input and the weight are scaled so that the tensor's largest magnitude
  (amax) lands on float8's largest finite value, cast to e4m3 (3 mantissa bits: precision),
  and multiplied by `_scaled_mm`, which accumulates in fp32 and undoes both scales;
- in backward, the output gradient is cast the same way to e5m2 (2 mantissa bits, 5 exponent
  bits: gradients span a wider range), and both gradient matmuls (input and weight) run in fp8
  against the e4m3 tensors saved by forward;
- the master weights stay fp32 (the optimizer never sees float8), and bf16 autocast stays on
  around the model: norms, attention, the output head and the loss run in bf16 as with
  `dtype: bf16`. The output head and the embedding are not swapped (torchao's advice: the
  logits are the most precision-sensitive matmul; the embedding is a lookup).

`Backend.SCALED_MM` needs fp8 matmuls in hardware: CUDA capability 8.9 or newer (Ada, Hopper,
Blackwell). `Backend.EMULATED` quantizes and dequantizes through the same float8 dtypes and
multiplies in fp32: the same numbers on any device, which is how the CPU tests check the
scaling math (trainer/fp8_test.py). The trainer uses only SCALED_MM and refuses fp8 elsewhere.
"""

import enum

import torch
from torch import nn

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.defaults import FP8_DTYPES

FIELD = "trainer.train.dtype"
MIN_CAPABILITY = (8, 9)  # the first CUDA architectures with fp8 tensor cores (Ada, Hopper)
ALIGN = 16  # _scaled_mm wants both matmul dimensions of the weight divisible by 16
EPS = 1e-12  # an all-zero tensor gets a finite scale (torchao's floor on amax)


class Float8Format(enum.Enum):
    E4M3 = torch.float8_e4m3fn  # weights and activations (forward)
    E5M2 = torch.float8_e5m2  # gradients (backward)

    @property
    def max(self) -> float:
        return float(torch.finfo(self.value).max)


class Backend(enum.Enum):
    SCALED_MM = "scaled_mm"  # torch._scaled_mm: fp8 tensor cores
    EMULATED = "emulated"  # quantize-dequantize, then an fp32 matmul (tests, any device)


def enabled(cfg: trainer_config_pb2.TrainerConfig) -> bool:
    return cfg.train.dtype.lower() in FP8_DTYPES


def backend_for(device: torch.device) -> Backend:
    """SCALED_MM where the device has fp8 matmuls; else a ConfigError naming train.dtype."""
    if device.type != "cuda":
        raise ConfigError(
            FIELD,
            f"fp8 needs fp8 matmuls (a CUDA GPU of capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: Ada, Hopper, Blackwell); this job "
            f"runs on {device.type}: use bf16",
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            FIELD,
            f"fp8 needs CUDA capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ for fp8 "
            f"matmuls; {name} is {capability[0]}.{capability[1]}: use bf16",
        )
    return Backend.SCALED_MM


def scale_for(amax: torch.Tensor, fmt: Float8Format) -> torch.Tensor:
    """The fp32 factor that maps amax onto the format's largest finite value."""
    return (fmt.max / amax.float().clamp(min=EPS)).to(torch.float32)


def to_float8(x: torch.Tensor, fmt: Float8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * scale in `fmt`, scale), with one scale for the whole tensor (tensorwise)."""
    scale = scale_for(x.detach().abs().max(), fmt)
    data = (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.value)
    return data, scale


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    backend: Backend,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) in `out_dtype`, for float8 `a` (M, K) and `b` (K, N)."""
    if backend is Backend.EMULATED:
        return ((a.float() / a_scale) @ (b.float() / b_scale)).to(out_dtype)
    short = -a.shape[1] % ALIGN
    if short:  # the inner dim must be a multiple of 16 too: grad_w's is the token count
        a = torch.cat([a, a.new_zeros(a.shape[0], short)], dim=1)  # zeros add nothing
        b = torch.cat([b, b.new_zeros(short, b.shape[1])], dim=0)
    # cuBLASLt's fp8 matmul takes the left operand row-major and the right column-major.
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(0) == 1 else b.t().contiguous().t()
    return torch._scaled_mm(
        a,
        b,
        scale_a=a_scale.reciprocal(),
        scale_b=b_scale.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _Float8Matmul(torch.autograd.Function):
    """y = x @ w.T with both operands in e4m3; the gradients' matmuls with e5m2 grad_y."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype, backend):
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_scale = to_float8(x2, Float8Format.E4M3)
        w8, w_scale = to_float8(weight, Float8Format.E4M3)
        ctx.save_for_backward(x8, x_scale, w8, w_scale)
        ctx.backend, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = backend, x.shape, x.dtype, weight.dtype
        # fast accumulation in forward only, as torchao does: gradients keep full accumulation
        y = scaled_mm(x8, x_scale, w8.t(), w_scale, out_dtype, backend, fast_accum=True)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        g8, g_scale = to_float8(g2, Float8Format.E5M2)
        grad_x = scaled_mm(g8, g_scale, w8, w_scale, grad_y.dtype, ctx.backend)
        grad_w = scaled_mm(g8.t(), g_scale, x8, x_scale, torch.float32, ctx.backend)
        return grad_x.reshape(ctx.x_shape).to(ctx.x_dtype), grad_w.to(ctx.w_dtype), None, None


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmul runs in float8; same parameters (names, dtype, state dict),
    so checkpoints, the optimizer and FSDP/DDP see an ordinary Linear."""

    backend: Backend

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: Backend) -> "Float8Linear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters, not copies
        new.backend = backend
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        )
        y = _Float8Matmul.apply(x, self.weight, out_dtype, self.backend)
        return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", float8 ({self.backend.value})"


def swappable(name: str, module: nn.Module) -> bool:
    """A Linear of the model's blocks whose shape _scaled_mm takes; not the output head."""
    return (
        type(module) is nn.Linear
        and name.split(".")[-1] != "output"
        and module.in_features % ALIGN == 0
        and module.out_features % ALIGN == 0
    )


def convert(model: nn.Module, backend: Backend) -> list[str]:
    """Swaps every swappable Linear of `model` for a Float8Linear in place; returns their names."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not swappable(name, module):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        assert isinstance(module, nn.Linear)
        setattr(parent, child, Float8Linear.from_linear(module, backend))
        swapped.append(name)
    return swapped
