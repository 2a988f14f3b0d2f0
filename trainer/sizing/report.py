"""A plan as data (`Plan`: what `plan --json` prints) and as people read it (`render`: each
quantity scaled to a readable unit, beside its formula)."""

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer.sizing.comm import ModelShape
from trainer.sizing.memory import GIB

SHARDING_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3/FSDP"}


@dataclass(frozen=True)
class Quantity:
    """One number of the plan, with its unit and the formula that produced it."""

    value: float | None  # None: not defined (e.g. no whole gradient accumulation)
    unit: str
    formula: str


q = Quantity


@dataclass(frozen=True)
class ModelSection:
    shape: ModelShape
    parameters: Quantity
    params_per_layer: Quantity
    non_embedding: Quantity


@dataclass(frozen=True)
class ComputeSection:
    tokens: Quantity
    flops_per_token: Quantity
    attention_share: Quantity
    total_flops: Quantity


@dataclass(frozen=True)
class TimeSection:
    accelerator: str
    peak_flops_per_gpu: Quantity
    mfu: Quantity
    cluster_flops: Quantity
    tokens_per_second: Quantity
    wall_clock: Quantity
    gpu_hours: Quantity


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model state per GPU under one sharding."""

    weights: Quantity
    gradients: Quantity
    optimizer: Quantity
    master: Quantity  # an fp32 copy beside 16-bit (or float8) weights; 0 in fp32
    total: Quantity


@dataclass(frozen=True)
class Fit:
    bytes: float  # the peak: model states + activations + output layer + backward
    fits: bool  # in the usable memory


@dataclass(frozen=True)
class MemorySection:
    precision: str  # trainer/sizing/precision.py's Precision value: fp32, bf16, fp16, fp8
    precision_note: str
    bytes_per_param: dict[str, float]  # weights, gradients, optimizer, master, total
    model_states: dict[str, ModelStates]  # by sharding: ddp, zero1, zero2, zero3
    activations_per_layer: dict[str, Quantity]  # by recompute mode: none, selective, full
    activations_by_precision: dict[str, float]  # recompute none, bytes per layer, by precision
    activation_note: str
    output_layer: Quantity
    backward_transient: dict[str, Quantity]  # by recompute mode
    device_memory: Quantity
    usable_memory: Quantity
    fits: dict[str, dict[str, Fit]]  # by sharding, then recompute mode
    fits_formula: str


@dataclass(frozen=True)
class CriticalBatchPrior:
    tokens_at_loss: dict[str, float]  # B_crit in tokens, by loss ("4", "3", "2.5", "2")
    formula: str
    loss_where_critical: float  # the loss at which this batch is the prior's B_crit


@dataclass(frozen=True)
class BatchSection:
    global_batch: Quantity
    global_batch_tokens: Quantity
    step_time: Quantity
    max_data_parallel: Quantity
    grad_accumulation: Quantity
    critical_batch_prior: CriticalBatchPrior
    warnings: list[str]


@dataclass(frozen=True)
class Plan:
    inputs: dict[str, Any]  # the flags, defaults filled in
    model: ModelSection
    compute: ComputeSection
    time: TimeSection
    memory: MemorySection
    batch: BatchSection
    moe: Any = None  # trainer/sizing/moe.py's MoESection, for a mixture-of-experts model

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _si(x: float, prefixes: str = " KMGTPE") -> str:
    i = 0
    while abs(x) >= 1000 and i < len(prefixes) - 1:
        x, i = x / 1000, i + 1
    return f"{x:.3g} {prefixes[i]}".rstrip()


def fmt(item: Quantity) -> str:
    """A quantity for people: its value in a readable scale, with the unit."""
    v, unit = item.value, item.unit
    if v is None:
        return "n/a"
    if unit in ("params", "tokens", "tokens/s"):
        return f"{_si(v, ' KMBT')} {unit}"
    if unit == "FLOP":
        return f"{v:.3g} FLOP" if v >= 1e15 else f"{_si(v)}FLOP".replace(" FLOP", "FLOP", 1)
    if unit == "FLOP/s":
        return f"{_si(v)}FLOP/s" if v >= 1000 else f"{v:.3g} FLOP/s"
    if unit == "fraction":
        return f"{100 * v:.1f}%"
    if unit == "B":
        return f"{v / GIB:,.2f} GiB" if v >= GIB else f"{v / 2**20:,.1f} MiB"
    if unit == "s":
        for size, name in ((86400, "days"), (3600, "hours"), (60, "min")):
            if v >= 2 * size:
                return f"{v / size:,.1f} {name}"
        return f"{v:.3g} s"
    return f"{v:,.0f} {unit}" if abs(v) >= 100 else f"{v:.3g} {unit}"


def render(plan: Plan) -> str:
    m, c, t, mem, b = plan.model, plan.compute, plan.time, plan.memory, plan.batch
    s, inputs = m.shape, plan.inputs
    lines = [
        f"Plan for a {s.layers}-layer Llama-style model: d {s.dim}, {s.heads} heads "
        f"({s.kv_heads} KV) of {s.head_dim}, SwiGLU {s.ffn_dim}, vocab {s.vocab}, "
        f"{'tied' if s.tie_embeddings else 'untied'} embeddings",
        "(each line: name, value, the formula that produced it; N = non-embedding parameters,",
        " L layers, H heads, Q head dim, T = s sequence length, b micro batch, h = d, a = H)",
    ]

    def row(label: str, item: Quantity) -> None:
        lines.append(f"  {label:<22}{fmt(item):>16}   {item.formula}")

    def section(title: str) -> None:
        lines.extend(["", title])

    section("MODEL")
    row("parameters", m.parameters)
    row("per layer", m.params_per_layer)
    row("non-embedding N", m.non_embedding)
    if plan.moe is not None:
        e = plan.moe
        section(f"MIXTURE OF EXPERTS: {e.experts}")
        row("total parameters", e.total)
        row("active per token", e.active)
        row("active share", e.active_share)
        row("routed experts", e.routed_experts)
        row("held per rank", e.params_per_rank)
        row("all-to-all per step", e.all_to_all_per_step)
        row("MFU on total params", e.mfu_if_quoted_on_total)
        lines.append("  (N above and FLOPs below count the active parameters; memory holds all)")
    section("COMPUTE")
    row("training tokens", c.tokens)
    row("FLOPs per token", c.flops_per_token)
    row("attention share", c.attention_share)
    row("total FLOPs", c.total_flops)
    section(f"TIME on {inputs['gpus']} × {t.accelerator} ({inputs['dtype']})")
    row("peak per device", t.peak_flops_per_gpu)
    row("MFU", t.mfu)
    row("achieved, all GPUs", t.cluster_flops)
    row("throughput", t.tokens_per_second)
    row("wall clock", t.wall_clock)
    row("GPU-hours", t.gpu_hours)

    per = mem.bytes_per_param
    section(f"MEMORY PER GPU: model states, {mem.precision}, {per['total']:g} bytes/parameter")
    ranks = min(inputs["gpus"], int(plan.batch.max_data_parallel.value or inputs["gpus"]))
    lines.append(f"  ({mem.precision_note}; R = {ranks} data-parallel ranks)")
    lines.append(
        "  bytes per parameter: "
        + ", ".join(f"{k} {v:g}" for k, v in per.items() if k != "total")
        + " (trainer/sizing/precision.py)"
    )
    # one space between columns: 1,234.56 GiB fills a column of 12
    heads = ("weights", "gradients", "optimizer", "master", "total")
    lines.append(f"  {'':<12}" + "".join(f"{' ' + h:>13}" for h in heads))
    for sharding, st in mem.model_states.items():
        parts = (st.weights, st.gradients, st.optimizer, st.master)
        cells = "".join(f" {fmt(x):>12}" for x in parts)
        formula = " + ".join(x.formula for x in parts)
        lines.append(f"  {SHARDING_LABELS[sharding]:<12}{cells} {fmt(st.total):>12}   {formula}")
    lines.append(
        f"  activations per layer (Korthikanti et al. 2022), micro batch {inputs['micro_batch']}"
        f" × {inputs['seq_len']} tokens,"
    )
    lines.append(f"  {mem.activation_note}:")
    for mode, item in mem.activations_per_layer.items():
        row(f"  recompute {mode}", item)
    by_precision = ", ".join(
        f"{name} {fmt(q(v, 'B', ''))}" for name, v in mem.activations_by_precision.items()
    )
    lines.append(f"    recompute none by precision: {by_precision}")
    row("  output layer + loss", mem.output_layer)
    lines.append("  backward working set (built while the backward pass runs):")
    for mode, item in mem.backward_transient.items():
        row(f"  recompute {mode}", item)
    if inputs["attention"] == "flash":
        lines += [
            "    (flash attention recomputes the a·s² scores inside its backward: 'none' costs",
            "     what 'selective' costs; memory.layer_activations' defaults, 2 bytes everywhere",
            "     and a 4h GeLU MLP, give the paper's s·b·h·(34 + 5·a·s/h))",
        ]
    lines += [
        f"  what fits in {fmt(mem.usable_memory)}, {mem.usable_memory.formula} of "
        f"{fmt(mem.device_memory)}:",
        f"    {mem.fits_formula}",
    ]
    modes = list(mem.activations_per_layer)
    lines.append(f"  {'':<12}" + "".join(f"{'recompute ' + mode:>22}" for mode in modes))
    for sharding, by_mode in mem.fits.items():
        cells = "".join(
            f"{('fits ' if x.fits else 'NO ') + fmt(q(x.bytes, 'B', '')):>22}"
            for x in by_mode.values()
        )
        lines.append(f"  {SHARDING_LABELS[sharding]:<12}{cells}")

    section("BATCH")
    row("global batch", b.global_batch)
    row("tokens per step", b.global_batch_tokens)
    row("step time", b.step_time)
    row("max useful DP degree", b.max_data_parallel)
    row("grad accumulation", b.grad_accumulation)
    crit = b.critical_batch_prior
    priors = ", ".join(f"{k}: {fmt(q(v, 'tokens', ''))}" for k, v in crit.tokens_at_loss.items())
    lines += [
        "  critical batch prior at a loss (nats/token) of",
        f"    {priors}",
        f"    {crit.formula}",
        f"  this batch is the prior's B_crit at a loss of {crit.loss_where_critical:.2f} nats;"
        " above that loss",
        "    (early in training) it is larger than critical and more data parallelism buys less",
        "    than linear speed-up (McCandlish et al. 2018: B_crit ≈ B_noise = tr(Σ)/|G|², which",
        "    grows as the loss falls; the trainer measures B_simple online: compare the two)",
    ]
    lines += [f"  WARNING: {w}" for w in b.warnings]
    return "\n".join(lines)
