"""Memory per GPU for training: model states (weights, gradients, optimizer) and activations.

Model states, Adam, bytes per parameter (Rajbhandari et al. 2019, "ZeRO"):

    layout   weights  gradients  optimizer                              total
    mixed    2 (bf16)  2 (bf16)  12 (fp32 master copy + momentum + variance)  16
    fp32     4 (fp32)  4 (fp32)   8 (fp32 momentum + variance)               16

"mixed" is Megatron/DeepSpeed mixed precision. "fp32" is what PyTorch-native training keeps:
fp32 parameters with bf16 autocast on a GPU (FSDP2 shards the fp32 parameters and gathers bf16
copies per layer), and plain fp32 training on a CPU; the Kitchen trainer is "fp32" in both cases.
The totals agree; the split matters once things are sharded across R data-parallel ranks:

    DDP     everything replicated:           W + G + O
    ZeRO-1  optimizer state sharded:         W + G + O/R
    ZeRO-2  + gradients sharded:             W + (G + O)/R
    ZeRO-3  + weights sharded (FSDP):        (W + G + O)/R

Activations saved for the backward pass, per transformer layer (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", s = sequence length,
b = micro batch, h = hidden size, a = attention heads, 16-bit activations, no tensor parallelism):

    no recomputation          s·b·h·(34 + 5·a·s/h) bytes
    selective (attention)     34·s·b·h bytes   (the a·s² score/softmax tensors are recomputed)
    full (whole layer)        2·s·b·h bytes    (only the layer's input is kept)

The 34 counts 16 hidden-sized tensors of 2 bytes (attention 5, MLP 9, norms 2) plus two 1-byte
dropout masks; the 5 counts the softmax output and the dropout output (2 bytes each) plus the
dropout mask (1 byte). `bytes_per_element` and `dropout` make those counts explicit: fp32 CPU
training has 4-byte elements, and Llama-style blocks (Kitchen's) have no dropout, which leaves
s·b·h·(16·e + a·s·e/h). Flash attention (SDPA's kernels on a GPU, the variable-length path)
never stores the a·s² scores: it recomputes them inside its backward, which is Korthikanti's
selective recomputation done by the kernel, so with `flash_attention` "none" costs what
"selective" costs (plus a logsumexp of 4·a·s·b bytes, negligible).

Korthikanti's count is what is saved; the peak adds what the backward pass builds while it runs:
the gradient of the fp32 logits (4·s·b·V, gone with a fused linear cross-entropy) and, with
recomputation, one layer's activations rebuilt at a time (`backward_transient_bytes`).
"""

from dataclasses import dataclass

GIB = 2**30

LAYOUTS = {
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
}
SHARDINGS = ("ddp", "zero1", "zero2", "zero3")
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelStateBytes:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(
    n_params: float, *, layout: str = "mixed", sharding: str = "ddp", world_size: int = 1
) -> ModelStateBytes:
    """Bytes per GPU of weights, gradients and Adam state for `n_params` parameters."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {sorted(LAYOUTS)}, got {layout!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: expected one of {list(SHARDINGS)}, got {sharding!r}")
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    w, g, o = (n_params * per_param for per_param in LAYOUTS[layout])
    level = SHARDINGS.index(sharding)  # 0 ddp, 1 optimizer, 2 + gradients, 3 + weights
    r = world_size
    return ModelStateBytes(
        weights=w / r if level >= 3 else w,
        gradients=g / r if level >= 2 else g,
        optimizer=o / r if level >= 1 else o,
    )


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    n_heads: int,
    recompute: str = "none",
    *,
    bytes_per_element: int = 2,
    dropout: bool = True,
    flash_attention: bool = False,
    kv_heads: int | None = None,
    ffn_dim: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, see module doc).

    Korthikanti's 16 hidden-sized tensors, by where they live: 4 outside the tensor-parallel
    regions (2 norm inputs, the inputs of the QKV and the first MLP projection: whole on every
    TP rank unless `sequence_parallel`) and 12 inside (split t ways): Q, K, V and the attention
    output projection's input (4), the GeLU MLP's 4h-wide input and output (8). With
    `kv_heads` (grouped-query attention) K and V count kv_heads/heads of a tensor each; with
    `ffn_dim` (a SwiGLU MLP, Llama's and Kitchen's) the MLP keeps its gate, up, silu(gate) and
    product: 4·ffn_dim/h tensors. Defaults give Korthikanti's formula exactly.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: expected one of {list(RECOMPUTE_MODES)}, got {recompute!r}")
    s, b, h, a, e = seq_len, micro_batch, hidden, n_heads, bytes_per_element
    t = tp
    outside = t if sequence_parallel else 1  # the norms' region is split by SP only
    if recompute == "full":
        return s * b * h * e / outside
    kv = (kv_heads if kv_heads is not None else a) / a
    mlp = 4 * ffn_dim / h if ffn_dim is not None else 8.0
    inside = 2 + 2 * kv + mlp
    masks = 2 if dropout else 0  # the two 1-byte dropout masks after attention and MLP
    per_layer = s * b * h * ((4 * e + masks) / outside + inside * e / t)
    if recompute == "none" and not flash_attention:
        per_layer += a * s * s * b * ((2 * e + 1) if dropout else e) / t
    return per_layer


def backward_transient_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    n_heads: int,
    vocab: int,
    recompute: str = "none",
    *,
    bytes_per_element: int = 2,
    dropout: bool = True,
    flash_attention: bool = False,
) -> float:
    """Bytes the backward pass adds to what was saved: 4·s·b·V + (none − recompute) for a layer.

    The loss's gradient with respect to the fp32 logits, then, with recomputation, the
    activations of the one layer being recomputed.
    """

    def layer(mode: str) -> float:
        return activation_bytes_per_layer(
            seq_len,
            micro_batch,
            hidden,
            n_heads,
            mode,
            bytes_per_element=bytes_per_element,
            dropout=dropout,
            flash_attention=flash_attention,
        )

    rebuilt, kept = layer("none"), layer(recompute)
    return 4 * seq_len * micro_batch * vocab + rebuilt - kept


def output_layer_activation_bytes(
    seq_len: int, micro_batch: int, hidden: int, vocab: int, *, bytes_per_element: int = 2
) -> float:
    """Bytes kept by the final norm, the output projection and the loss: 2·s·b·h·e + 4·s·b·v.

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
