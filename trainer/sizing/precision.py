"""What each training precision keeps in memory, per parameter and per saved activation.

The planner's own enum: the trainer's `train.dtype` is a string (protos/defaults.py DTYPES
spells it), mapped here by name (`from_config_dtype`), so a new spelling there needs no proto.

Bytes per parameter, with Adam (momentum and variance, fp32, 8 bytes, in every precision):

    precision  weights            gradients  optimizer  master copy  total
    fp32       4 (the parameters)      4        8          -          16
    bf16       2 (autocast copies)     4        8          4          18
    fp16       2 (autocast copies)     4        8          4          18
    fp8        1 (float8 casts)        4        8          4          17

fp32: nothing but fp32 tensors. bf16 (the CUDA default) and fp16 are PyTorch autocast: the
parameters stay fp32 (they are the master copy the optimizer updates, and their gradients are
fp32 because autograd accumulates into the parameter's dtype), and autocast casts each weight
to 16 bits the first time a matmul uses it, caching the copy until the forward pass ends; the
linear layers save those copies for their backward, so they live through the whole step: 2
bytes per matmul parameter, counted here on every parameter (an upper bound by the norms'
weights and, with untied embeddings, the input table, which autocast leaves in fp32). fp16
adds a GradScaler: one scale and one found-inf flag (bytes, not per parameter; it unscales
the fp32 gradients in place).

fp8 is Kitchen's own float8 training (trainer/fp8.py, torchao's design on `torch._scaled_mm`):
  - weights: the fp32 parameters are the master copy; each Float8Linear casts its weight to
    e4m3 per step with a dynamic (tensorwise) scale and saves that cast for backward: 1 byte
    per matmul parameter, counted on every parameter (an upper bound by the output head and
    the embedding, which stay bf16 under autocast);
  - gradients fp32 (the parameters' dtype), Adam fp32;
  - activations: bf16 autocast stays on around the float8 matmuls, so norms and attention
    save bf16; each swapped linear saves its *float8* input (`ctx.save_for_backward(x8, ...)`
    in trainer/fp8.py), 1 byte per element. (torchao's default linear saves the bf16 input
    instead and casts it again in backward: 2 bytes; `LINEAR_INPUT_BYTES_FP8` is the one
    place to change if the trainer ever follows it.)

Activations (`ActivationBytes`): under autocast the residual stream stays fp32 (a bf16 matmul
output added to an fp32 residual promotes to fp32), so the norms' inputs are 4 bytes, and
each projection casts its input separately (q, k and v each save their own 16-bit copy of the
normed input; so do the MLP's gate and up projections).
"""

import enum
from dataclasses import dataclass


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"  # autocast, fp32 master weights: the CUDA default
    FP16 = "fp16"  # autocast with dynamic loss scaling
    FP8 = "fp8"  # torchao float8 matmuls, bf16 autocast elsewhere


@dataclass(frozen=True)
class StateBytesPerParam:
    """Bytes per parameter of each model state. `master` is an fp32 copy kept beside the
    weights the matmuls use; ZeRO counts it with the optimizer state (its K = 12)."""

    weights: float
    gradients: float
    optimizer: float
    master: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.master


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes per element of what a layer saves for backward."""

    element: int  # matmul inputs and outputs, attention's q, k, v and output, the MLP's
    residual: int  # the residual stream: the norms' inputs
    linear_input: int  # a linear layer's saved input
    input_cast_per_projection: bool  # autocast: q, k, v (and gate, up) each save a cast


@dataclass(frozen=True)
class PrecisionSpec:
    states: StateBytesPerParam
    activations: ActivationBytes
    note: str  # what is kept, for the report


ADAM_BYTES = 8  # fp32 momentum + variance
LINEAR_INPUT_BYTES_FP8 = 1  # trainer/fp8.py saves the e4m3 input (see the module doc)

SPECS = {
    Precision.FP32: PrecisionSpec(
        StateBytesPerParam(4, 4, ADAM_BYTES, 0),
        ActivationBytes(4, 4, 4, False),
        "fp32 weights + fp32 gradients + fp32 momentum, variance (no master copy)",
    ),
    Precision.BF16: PrecisionSpec(
        StateBytesPerParam(2, 4, ADAM_BYTES, 4),
        ActivationBytes(2, 4, 2, True),
        "bf16 autocast copies + fp32 gradients + fp32 momentum, variance"
        " + the fp32 parameters as master",
    ),
    Precision.FP16: PrecisionSpec(
        StateBytesPerParam(2, 4, ADAM_BYTES, 4),
        ActivationBytes(2, 4, 2, True),
        "fp16 autocast copies + fp32 loss-scaled gradients + fp32 momentum, variance"
        " + the fp32 parameters as master",
    ),
    Precision.FP8: PrecisionSpec(
        StateBytesPerParam(1, 4, ADAM_BYTES, 4),
        ActivationBytes(2, 4, LINEAR_INPUT_BYTES_FP8, True),
        "float8 casts (trainer/fp8.py) + fp32 gradients + fp32 momentum, variance"
        " + the fp32 parameters as master",
    ),
}

# Megatron/DeepSpeed mixed precision, the ZeRO paper's accounting (2 + 2 + K, K = 12): bf16
# weights and gradients as the model's own tensors. Not a precision Kitchen trains in (PyTorch
# autocast keeps fp32 parameters); kept to check the planner against the paper's figures.
ZERO_PAPER_MIXED = StateBytesPerParam(2, 2, ADAM_BYTES, 4)


def default_precision(on_cuda: bool) -> Precision:
    """The trainer's automatic choice (train.dtype ""): bf16 on CUDA, fp32 elsewhere."""
    return Precision.BF16 if on_cuda else Precision.FP32


def from_config_dtype(name: str, *, on_cuda: bool) -> Precision:
    """The precision a `train.dtype` spelling trains in, by name (protos/defaults.py DTYPES and
    FP8_DTYPES; "" is automatic)."""
    from protos.defaults import DTYPES, FP8_DTYPES

    key = name.strip().lower()
    if not key:
        return default_precision(on_cuda)
    if key in FP8_DTYPES:
        return Precision.FP8
    torch_name = DTYPES.get(key)
    by_torch = {
        "float32": Precision.FP32,
        "bfloat16": Precision.BF16,
        "float16": Precision.FP16,
    }
    if torch_name is None or torch_name not in by_torch:
        raise ValueError(f"train.dtype: {name!r} is not one of {sorted(k for k in DTYPES if k)}")
    return by_torch[torch_name]
