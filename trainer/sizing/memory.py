"""Memory per GPU for training: model states (weights, gradients, optimizer) and activations.

Model states, Adam, bytes per parameter by precision: trainer/sizing/precision.py (fp32 16;
bf16 and fp16 autocast 18, the fp32 parameters being the master copy beside the 16-bit
autocast copies; fp8 17). The ZeRO paper's mixed precision (Rajbhandari et al. 2019: 2 + 2 +
K, K = 12) is `precision.ZERO_PAPER_MIXED`. Sharded across R data-parallel ranks:

    DDP     everything replicated:                       W + G + O + M
    ZeRO-1  optimizer state (and master copy) sharded:   W + G + (O + M)/R
    ZeRO-2  + gradients sharded:                         W + (G + O + M)/R
    ZeRO-3  + weights sharded (FSDP):                    (W + G + O + M)/R

Activations saved for the backward pass, per transformer layer (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", s = sequence length,
b = micro batch, h = hidden size, a = attention heads, 16-bit activations, no tensor parallelism):

    no recomputation          s·b·h·(34 + 5·a·s/h) bytes
    selective (attention)     34·s·b·h bytes   (the a·s² score/softmax tensors are recomputed)
    full (whole layer)        2·s·b·h bytes    (only the layer's input is kept)

The 34 counts 16 hidden-sized tensors of 2 bytes (attention 5, MLP 9, norms 2) plus two 1-byte
dropout masks; the 5 counts the softmax output and the dropout output (2 bytes each) plus the
dropout mask (1 byte). `layer_activations` makes those counts explicit (by precision, for
grouped-query attention and a SwiGLU MLP: its docstring), one formula for the plan and the
per-layout costing (recommend.py); without dropout (Llama-style blocks, Kitchen's) they leave
s·b·h·(16·e + a·s·e/h) at one element size e. Flash attention (SDPA's kernels on a GPU, the
variable-length path) never stores the a·s² scores: it recomputes them inside its backward,
which is Korthikanti's selective recomputation done by the kernel, so with `flash_attention`
"none" costs what "selective" costs (plus a logsumexp of 4·a·s·b bytes, negligible).

Korthikanti's count is what is saved; the peak adds what the backward pass builds while it runs:
the gradient of the fp32 logits (4·s·b·V, gone with a fused linear cross-entropy) and, with
recomputation, one layer's activations rebuilt at a time (`backward_transient_bytes`).
"""

from dataclasses import dataclass

from trainer.sizing.precision import ActivationBytes, StateBytesPerParam

GIB = 2**30
KORTHIKANTI = ActivationBytes(2, 2, 2, False)  # the paper's case: every saved tensor 16-bit

SHARDINGS = ("ddp", "zero1", "zero2", "zero3")
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelStateBytes:
    weights: float
    gradients: float
    optimizer: float
    master: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.master


def model_state_bytes(
    n_params: float,
    *,
    per_param: StateBytesPerParam,
    sharding: str = "ddp",
    world_size: int = 1,
) -> ModelStateBytes:
    """Bytes per GPU of weights, gradients, Adam state and master copy for `n_params`
    parameters kept as `per_param` says (precision.SPECS[p].states)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: expected one of {list(SHARDINGS)}, got {sharding!r}")
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    w, g, o, m = (
        n_params * x
        for x in (per_param.weights, per_param.gradients, per_param.optimizer, per_param.master)
    )
    level = SHARDINGS.index(sharding)  # 0 ddp, 1 optimizer, 2 + gradients, 3 + weights
    r = world_size
    return ModelStateBytes(
        weights=w / r if level >= 3 else w,
        gradients=g / r if level >= 2 else g,
        optimizer=o / r if level >= 1 else o,
        master=m / r if level >= 1 else m,
    )


@dataclass(frozen=True)
class LayerActivations:
    """One layer's saved bytes per s·b·h by where they live (Korthikanti's 16 tensors,
    generalized), and the a·s² term's bytes per score; `per_layer` multiplies them out."""

    norm_inputs: float  # the residual stream at the two norms
    linear_inputs: float  # the QKV and MLP projections' inputs (+ dropout masks)
    attention: float  # q, k, v and the output projection's input
    mlp: float  # GeLU: its 4h input and output; SwiGLU: gate, up and their product
    score_bytes: float  # per a·s²·b element, when the scores are stored

    def formula(self, recompute: str, residual_bytes: int) -> str:
        if recompute == "full":
            return f"{residual_bytes}·s·b·h (the layer's input)"
        parts = (self.norm_inputs, self.linear_inputs, self.attention, self.mlp)
        text = (
            f"{sum(parts):.4g}·s·b·h = norms {parts[0]:.3g} + inputs {parts[1]:.3g}"
            f" + q,k,v,o {parts[2]:.3g} + MLP {parts[3]:.3g}"
        )
        if recompute == "none" and self.score_bytes:
            text += f" + {self.score_bytes:g}·a·s/h"
        return text


def layer_activations(
    hidden: int,
    n_heads: int,
    recompute: str = "none",
    *,
    sizes: ActivationBytes = KORTHIKANTI,
    dropout: bool = True,
    flash_attention: bool = False,
    kv_heads: int | None = None,
    ffn_dim: int | None = None,
    head_dim: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> LayerActivations:
    """What one transformer layer keeps for backward, per s·b·h (Korthikanti et al. 2022).

    Korthikanti's 16 hidden-sized tensors, by where they live: 4 outside the tensor-parallel
    regions (2 norm inputs, the inputs of the QKV and the first MLP projection: whole on every
    TP rank unless `sequence_parallel`) and 12 inside (split t ways): Q, K, V and the attention
    output projection's input (4), the GeLU MLP's 4h-wide input and output (8). With
    `kv_heads` (grouped-query attention) K and V count kv_heads/heads of a tensor each; with
    `ffn_dim` (a SwiGLU MLP, Llama's and Kitchen's) the MLP keeps gate and up (Kitchen's fused
    SwiGLU, kernels/ops/swiglu.py, saves those two and recomputes silu in backward) and the
    down projection's input, their product: 3·ffn_dim/h tensors (an unfused F.silu(gate) * up
    would keep silu(gate) as well: 4). With `head_dim` (heads of Q other than h/a, as
    Qwen3-30B-A3B's 32 of 128 on h 2048) Q, K, V and the attention output are a·Q/h as wide.
    `sizes` says the bytes of each kind (precision.py: under autocast the residual stream is
    fp32 and q, k, v and gate, up each save a cast of their input). Defaults (plain MHA, a 4h
    GeLU MLP, 2 bytes everywhere) give Korthikanti's formula exactly.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: expected one of {list(RECOMPUTE_MODES)}, got {recompute!r}")
    a, t, e = n_heads, tp, sizes.element
    outside = t if sequence_parallel else 1  # the norms' region is split by SP only
    if recompute == "full":
        return LayerActivations(sizes.residual / outside, 0, 0, 0, 0)
    kv = (kv_heads if kv_heads is not None else a) / a
    inputs = (3 + 2) if sizes.input_cast_per_projection else 2
    masks = 2 if dropout else 0  # the two 1-byte dropout masks after attention and MLP
    mlp = 3 * ffn_dim / hidden if ffn_dim is not None else 8.0
    scores = 0.0
    if recompute == "none" and not flash_attention:
        scores = ((2 * e + 1) if dropout else e) / t
    return LayerActivations(
        norm_inputs=2 * sizes.residual / outside,
        linear_inputs=(inputs * sizes.linear_input + masks) / outside,
        attention=(2 + 2 * kv) * (a * head_dim / hidden if head_dim else 1.0) * e / t,
        mlp=mlp * e / t,
        score_bytes=scores,
    )


def activation_bytes_per_layer(
    seq_len: int, micro_batch: int, hidden: int, n_heads: int, recompute: str = "none", **kw
) -> float:
    """Bytes one transformer layer keeps for backward: `layer_activations` (its keywords)
    times s·b·h, plus the a·s² scores where they are stored."""
    la = layer_activations(hidden, n_heads, recompute, **kw)
    s, b, h = seq_len, micro_batch, hidden
    per_sbh = la.norm_inputs + la.linear_inputs + la.attention + la.mlp
    return s * b * h * per_sbh + n_heads * s * s * b * la.score_bytes


def backward_transient_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    n_heads: int,
    vocab: int,
    recompute: str = "none",
    **kw,
) -> float:
    """Bytes the backward pass adds to what was saved: 4·s·b·V + (none − recompute) for a layer.

    The loss's gradient with respect to the fp32 logits, then, with recomputation, the
    activations of the one layer being recomputed. `kw`: `layer_activations`'s keywords.
    """
    rebuilt = activation_bytes_per_layer(seq_len, micro_batch, hidden, n_heads, "none", **kw)
    kept = activation_bytes_per_layer(seq_len, micro_batch, hidden, n_heads, recompute, **kw)
    return 4 * seq_len * micro_batch * vocab + rebuilt - kept


def output_layer_activation_bytes(
    seq_len: int, micro_batch: int, hidden: int, vocab: int, *, bytes_per_element: int = 2
) -> float:
    """Bytes kept by the final norm, the output projection and the loss: 2·s·b·h·e + 4·s·b·v
    (`e`: the precision's linear-input bytes; the norm input is its residual bytes).

    The 4·s·b·v term is the fp32 logits the cross-entropy keeps (Korthikanti et al.). An
    unfused loss briefly holds another copy or two; a fused linear cross-entropy kernel
    (kernels.fused_linear_cross_entropy) never materializes them.
    """
    return (
        2 * seq_len * micro_batch * hidden * bytes_per_element + 4 * seq_len * micro_batch * vocab
    )


def usable_bytes(memory_gib: float, headroom: float = 0.1) -> float:
    """Memory a plan may use: the device size less headroom for the runtime context, allocator
    fragmentation and communication buffers (10% by default)."""
    return memory_gib * GIB * (1.0 - headroom)
