"""Which layout to train a model with on N GPUs: per-rank memory, bytes, bubble, a step time.

For every layout the validation allows (comm.layouts), per rank:
  memory  = model states (the precision's bytes per parameter it holds, precision.py, ÷ the
            data-parallel ranks under FSDP, which shards over data parallel alone as
            trainer/parallel/shard.py does, plus FSDP's gathered layers: two layers' bf16
            weights, the one running and the one prefetched) + activations
            (memory.activation_bytes_per_layer in the precision's sizes, TP/SP split, s/c
            tokens, × the micro-batches in flight at the first pipeline stage) + the head's logits;
  time    = compute / (1 − bubble) + TP and CP bytes at NVLink speed (on the critical path)
            + pipeline bytes at network speed + the part of the gradient traffic that the
            backward pass (2/3 of the compute) cannot hide.
The recommendation is the fastest layout that fits, and the reason says what the simpler
layouts lacked. The speeds are assumptions, stated in NVLINK_BYTES_S and NETWORK_BYTES_S.
"""

import dataclasses

from protos.layout import ParallelLayout, Schedule
from trainer.sizing import comm, memory
from trainer.sizing.precision import SPECS, Precision

NVLINK_BYTES_S = 450e9  # per GPU per direction, H100/H200 NVLink 4 (900 GB/s both ways)
NETWORK_BYTES_S = 50e9  # per GPU: one 400 Gb/s NIC each
GPUS_PER_NODE = 8  # TP x CP groups stay on NVLink


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    layout: ParallelLayout
    micro_batches: int
    memory_bytes: float
    comm: comm.CommBytes
    bubble: float
    step_seconds: float
    fits: bool


def cost(
    shape: comm.ModelShape,
    lay: ParallelLayout,
    *,
    seq_len: int,
    global_batch: int,
    step_flops: float,
    peak_flops: float,
    mfu: float,
    memory_gib: float,
    precision: Precision = Precision.BF16,
) -> LayoutCost:
    """`global_batch` sequences per step, one per micro-batch per data-parallel rank;
    `step_flops`: the whole step's model FLOPs (6·N·tokens + attention)."""
    gpus = lay.world_size
    m = max(1, global_batch // lay.dp)
    if lay.pp > 1 and lay.schedule is Schedule.INTERLEAVED_1F1B:
        m = max(m, lay.pp)
    step = comm.Step(seq_len=seq_len, micro_batch=1, micro_batches=m)
    sent = comm.comm_bytes(shape, step, lay)
    params = comm.rank_params(shape, lay)
    spec = SPECS[precision]
    states = params * spec.states.total / (lay.dp if lay.fsdp else 1)
    if lay.fsdp:
        states += 2 * 2 * (params - shape.vocab * shape.dim) / max(shape.layers / lay.pp, 1)
    per_layer = memory.activation_bytes_per_layer(
        seq_len // lay.cp,
        1,
        shape.dim,
        shape.heads,
        sizes=spec.activations,
        dropout=False,
        flash_attention=True,
        kv_heads=shape.kv_heads,
        ffn_dim=shape.ffn_dim,
        head_dim=shape.head_dim,
        tp=lay.tp,
        sequence_parallel=lay.sequence_parallel,
    )
    in_flight = comm.in_flight_micro_batches(lay, m)
    activations = per_layer * shape.layers / lay.pp * in_flight
    activations += memory.output_layer_activation_bytes(
        seq_len // lay.cp, 1, shape.dim, shape.vocab, bytes_per_element=spec.activations.element
    )
    total = states + activations
    bubble = comm.bubble_fraction(lay, m)
    compute = step_flops / (gpus * peak_flops * mfu)
    exposed_data = max(0.0, sent.data / NETWORK_BYTES_S - compute * 2 / 3)
    seconds = (
        compute / (1 - bubble)
        + (sent.tensor + sent.context) / NVLINK_BYTES_S
        + sent.pipeline / NETWORK_BYTES_S
        + exposed_data
    )
    fits = total <= memory.usable_bytes(memory_gib)
    return LayoutCost(lay, m, total, sent, bubble, seconds, fits)


def candidates(shape: comm.ModelShape, gpus: int, seq_len: int, **kw) -> list[LayoutCost]:
    """Every allowed layout of `gpus` ranks, costed, fastest first."""
    out = []
    for lay in comm.layouts(gpus, shape, seq_len):
        if lay.tp * lay.cp > GPUS_PER_NODE or lay.dp > kw["global_batch"]:
            continue
        out.append(cost(shape, lay, seq_len=seq_len, **kw))
    return sorted(out, key=lambda c: c.step_seconds)


def recommend(costs: list[LayoutCost]) -> tuple[LayoutCost | None, str]:
    """The fastest layout that fits, and why (what the simpler ones lacked)."""
    fitting = [c for c in costs if c.fits]
    if not fitting:
        return None, "no layout fits: more GPUs, a shorter sequence or recomputation"
    best = fitting[0]
    gib = 2**30
    reasons = []
    plain = [c for c in costs if not c.layout.model_parallel]
    if plain and not any(c.fits for c in plain):
        smallest = min(plain, key=lambda c: c.memory_bytes)
        reasons.append(
            f"data parallel alone needs {smallest.memory_bytes / gib:,.0f} GiB per GPU even "
            f"sharded ({smallest.layout.describe()})"
        )
    reasons.append(
        f"{best.layout.describe()} fits in {best.memory_bytes / gib:,.0f} GiB, sends "
        f"{best.comm.total / 1e9:,.1f} GB per GPU per step, idles {best.bubble:.1%} in the "
        f"pipeline bubble with {best.micro_batches} micro-batches: "
        f"{best.step_seconds:.2f} s per step, the fastest of {len(fitting)} layouts that fit"
    )
    return best, "; ".join(reasons)


def render(costs: list[LayoutCost], best: LayoutCost | None, why: str, top: int = 12) -> str:
    """The layouts section of `plan --layouts`: the fastest `top`, then the choice."""
    gib = 2**30
    lines = [
        "layouts (per GPU; comm: bytes sent per step; time: compute/(1-bubble) + exposed comm)",
        f"  {'layout':<28}{'memory':>11}{'fits':>6}{'TP+CP comm':>13}{'PP comm':>11}"
        f"{'DP comm':>11}{'bubble':>8}{'step':>9}",
    ]
    for c in costs[:top]:
        fits = "yes" if c.fits else "NO"
        lines.append(
            f"  {c.layout.describe():<28}{c.memory_bytes / gib:>7,.1f} GiB{fits:>6}"
            f"{(c.comm.tensor + c.comm.context) / 1e9:>10,.2f} GB{c.comm.pipeline / 1e9:>8,.2f} GB"
            f"{c.comm.data / 1e9:>8,.1f} GB{c.bubble:>8.1%}{c.step_seconds:>7.2f} s"
        )
    lines.append(f"  recommended: {best.layout.describe() if best else 'none'}")
    lines.append(f"    why: {why}")
    lines.append(
        f"    assumed: NVLink {NVLINK_BYTES_S / 1e9:.0f} GB/s and network "
        f"{NETWORK_BYTES_S / 1e9:.0f} GB/s per GPU, {GPUS_PER_NODE} GPUs per node, no "
        "recomputation, flash attention, 1 sequence per micro-batch"
    )
    return "\n".join(lines)
