"""Bytes each rank sends per training step under a parallel layout, the pipeline bubble, and
the layout to pick (docs/parallelism.md). The formulas follow what trainer/parallel does:

Ring collectives over n ranks of a buffer of N bytes: an all-reduce sends 2·(n−1)/n·N per
rank, an all-gather or a reduce-scatter (n−1)/n·N. Per step, with m micro-batches of b rows of
s tokens (each rank of a context-parallel group holds s/c of them), activations of e bytes:

    TP  (t ranks)  4 all-reduces of b·(s/c)·d·e per layer and micro-batch (2 forward, 2
                   backward); with sequence parallelism each is a reduce-scatter plus an
                   all-gather: the same bytes.
    CP  (c ranks)  keys and values all-gathered in each layer, their gradients
                   reduce-scattered: 2·2·(c−1)/c · b·s·(KVH/t)·Q·e per layer and micro-batch.
    PP  (p ranks)  each stage sends its output forward (with the int64 position and document
                   ids) and the gradient back: b·(s/c)·d·e each (÷t with sequence
                   parallelism), per micro-batch and stage boundary.
    DP  (r = data x context ranks) gradient all-reduce, fp32: 2·(r−1)/r · 4 · P_rank.
    FSDP (d = data ranks; trainer/parallel/shard.py, trainer/distributed.py) shards over data
                   parallel alone. A weight is all-gathered (e_w bytes, the compute dtype)
                   wherever it is needed sharded: (d−1)/d · e_w · P per gather. The blocks
                   (P_blocks: the rank's layers) reshard after forward and after backward, so
                   without a pipeline they are gathered twice per micro-batch; the root (P_root:
                   embedding, final norm, head) is not resharded after forward (FSDP2's root
                   keeps them for the backward that follows), so once per micro-batch:
                       (d−1)/d · e_w · (2·m·P_blocks + m·P_root).
                   Under a pipeline the stages keep their weights gathered after backward
                   (torch.distributed.pipelining turns reshard-after-backward off until the
                   step's last backward) and the blocks still reshard after each forward: a
                   stage gathers before its first action and after each of its m forwards
                   (its last action is a backward), whatever the schedule; the Stage modules are
                   roots, gathered once per step:
                       (d−1)/d · e_w · ((m+1)·P_blocks + P_root).
                   Gradients are reduce-scattered once per step (no sync before the last
                   micro-batch), fp32: (d−1)/d · 4 · P_rank. With context parallelism the
                   shards' gradients are then all-reduced over the c context ranks, counted
                   under CP: 2·(c−1)/c · 4 · P_rank/d. (Left out: the clipping norm's one fp32
                   scalar per weight tensor, all-reduced over the shards.)

The bubble of a pipeline of p stages with m micro-batches is (p−1)/(m+p−1) of the step;
interleaving v stages per rank makes it (p−1)/(v·m+p−1).
"""

import dataclasses
import math

from protos.layout import ParallelLayout, Schedule


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn_dim: int
    vocab: int
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: dim / heads

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.heads)


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step as one data-parallel rank sees it."""

    seq_len: int
    micro_batch: int  # rows per micro-batch per data-parallel rank
    micro_batches: int  # per step (grad_accum; the pipeline's m)
    activation_bytes: int = 2  # bf16 on a GPU, 4 for fp32 on a CPU


@dataclasses.dataclass(frozen=True)
class CommBytes:
    """Bytes one rank sends per step, by kind of parallelism."""

    tensor: float
    context: float
    pipeline: float
    data: float

    @property
    def total(self) -> float:
        return self.tensor + self.context + self.pipeline + self.data


def _ring(n: int) -> float:
    return (n - 1) / n


def rank_params(shape: ModelShape, lay: ParallelLayout) -> float:
    """Parameters on rank 0: its layers' share of the tensor-parallel weights, the norms
    whole, the input embedding (first stage) and, without a pipeline, the head and the final
    norm (trainer/parallel keeps embedding and head whole under TP)."""
    return _block_params(shape, lay) + _root_params(shape, lay)


def _block_params(shape: ModelShape, lay: ParallelLayout) -> float:
    """Rank 0's layers' parameters (FSDP shards each block on its own)."""
    d, q = shape.dim, shape.head_dim
    split = 2 * d * shape.heads * q + 2 * d * shape.kv_heads * q + 3 * d * shape.ffn_dim
    return shape.layers / lay.pp * (split / lay.tp + 2 * d)


def _root_params(shape: ModelShape, lay: ParallelLayout) -> float:
    """Rank 0's parameters outside the blocks: the embedding and, without a pipeline, the
    head and the final norm (FSDP's root)."""
    embedding = shape.vocab * shape.dim
    last_stage = (0 if shape.tie_embeddings else shape.vocab * shape.dim) + shape.dim
    return embedding + (last_stage if lay.pp == 1 else 0)


def _fsdp_gathers(shape: ModelShape, lay: ParallelLayout, m: int) -> float:
    """Parameters FSDP all-gathers on rank 0 per step (module docstring)."""
    blocks, root = _block_params(shape, lay), _root_params(shape, lay)
    if lay.pp > 1:
        return (m + 1) * blocks + root
    return 2 * m * blocks + m * root


def comm_bytes(shape: ModelShape, step: Step, lay: ParallelLayout) -> CommBytes:
    """Bytes rank 0 sends per step under `lay` (module docstring); with more than 2 pipeline
    stages the middle ranks send one message more per micro-batch, which is counted too."""
    e, m, b = step.activation_bytes, step.micro_batches, step.micro_batch
    local_seq = step.seq_len / lay.cp
    layers = shape.layers / lay.pp
    hidden = b * local_seq * shape.dim * e
    tensor = 0.0
    if lay.tp > 1:
        tensor = 4 * 2 * _ring(lay.tp) * hidden * layers * m
        if lay.sequence_parallel:  # the embedding's slice (backward), the final norm's gather
            tensor += _ring(lay.tp) * hidden * m * (2 if lay.pp == 1 else 1)
    kv = b * step.seq_len * (shape.kv_heads / lay.tp) * shape.head_dim * e
    context = 2 * 2 * _ring(lay.cp) * kv * layers * m if lay.cp > 1 else 0.0
    pipeline = 0.0
    if lay.pp > 1:
        boundary = hidden / (lay.tp if lay.sequence_parallel else 1)
        ids = b * local_seq * 8 + b * step.seq_len * 8  # int64 positions, document ids (whole)
        v = lay.virtual_stages
        # rank 0 sends forward from its v stages and back from v-1 (stage 0 sends nothing
        # back); a middle rank of a longer pipeline sends back from all v
        back = v - 1 if lay.pp == 2 else v
        pipeline = m * (v * (boundary + ids) + back * boundary)
    params = rank_params(shape, lay)
    if lay.fsdp and lay.dp > 1:  # the engine shards only when data parallel has ranks
        gathers = _ring(lay.dp) * e * _fsdp_gathers(shape, lay, m)
        data = gathers + _ring(lay.dp) * 4 * params
        if lay.cp > 1:
            context += 2 * _ring(lay.cp) * 4 * params / lay.dp
    elif lay.dp * lay.cp > 1:
        data = 2 * _ring(lay.dp * lay.cp) * 4 * params
    else:
        data = 0.0
    return CommBytes(tensor, context, pipeline, data)


def bubble_fraction(lay: ParallelLayout, micro_batches: int) -> float:
    """The share of a step a pipeline rank idles: (p−1)/(v·m+p−1); 0 without a pipeline."""
    p, v = lay.pp, lay.virtual_stages
    if p == 1:
        return 0.0
    if lay.schedule is not Schedule.INTERLEAVED_1F1B:
        v = 1
    return (p - 1) / (v * micro_batches + p - 1)


def in_flight_micro_batches(lay: ParallelLayout, micro_batches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: all of them
    under GPipe, at most p under 1F1B, p·(1 + (p−1)/(p·v)) under interleaving."""
    if lay.pp == 1:
        return 1.0
    if lay.schedule is Schedule.GPIPE:
        return float(micro_batches)
    if lay.schedule is Schedule.INTERLEAVED_1F1B:
        p, v = lay.pp, lay.virtual_stages
        return min(float(micro_batches), p * (1 + (p - 1) / (p * v)))
    return float(min(lay.pp, micro_batches))


def layouts(world_size: int, shape: ModelShape, seq_len: int, max_degree: int = 64):
    """Every layout of `world_size` ranks this model and sequence allow (the validation's
    divisibility rules), DP last."""
    powers = [2**k for k in range(int(math.log2(max_degree)) + 1)]
    for tp in powers:
        if shape.heads % tp or shape.kv_heads % tp or tp > 8:  # TP stays inside a node
            continue
        for pp in powers:
            if shape.layers % pp:
                continue
            for cp in powers:
                if seq_len % (2 * cp) or world_size % (tp * pp * cp):
                    continue
                dp = world_size // (tp * pp * cp)
                for fsdp in (False, True) if dp > 1 else (False,):
                    yield ParallelLayout(
                        dp=dp, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1, fsdp=fsdp
                    )
