"""How a plan reads for people: each quantity scaled to a readable unit, beside its formula."""

from trainer.sizing.memory import GIB

SHARDING_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3/FSDP"}


def quantity(value, unit: str, formula: str) -> dict:
    """One number of the plan, as printed and as serialized to JSON."""
    return {"value": value, "unit": unit, "formula": formula}


q = quantity


def _si(x: float, prefixes: str = " KMGTPE") -> str:
    i = 0
    while abs(x) >= 1000 and i < len(prefixes) - 1:
        x, i = x / 1000, i + 1
    return f"{x:.3g} {prefixes[i]}".rstrip()


def fmt(item: dict) -> str:
    """A quantity for people: its value in a readable scale, with the unit."""
    v, unit = item["value"], item["unit"]
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


def render(plan: dict) -> str:
    m, c, t, mem, b = (plan[k] for k in ("model", "compute", "time", "memory", "batch"))
    s = m["shape"]
    lines = [
        f"Plan for a {s['layers']}-layer Llama-style model: d {s['dim']}, {s['heads']} heads "
        f"({s['kv_heads']} KV) of {s['head_dim']}, SwiGLU {s['ffn_dim']}, vocab {s['vocab']}, "
        f"{'tied' if s['tie_embeddings'] else 'untied'} embeddings",
        "(each line: name, value, the formula that produced it; N = non-embedding parameters,",
        " L layers, H heads, Q head dim, T = s sequence length, b micro batch, h = d, a = H)",
    ]

    def row(label: str, item: dict) -> None:
        lines.append(f"  {label:<22}{fmt(item):>16}   {item['formula']}")

    def section(title: str) -> None:
        lines.extend(["", title])

    section("MODEL")
    row("parameters", m["parameters"])
    row("per layer", m["params_per_layer"])
    row("non-embedding N", m["non_embedding"])
    section("COMPUTE")
    row("training tokens", c["tokens"])
    row("FLOPs per token", c["flops_per_token"])
    row("attention share", c["attention_share"])
    row("total FLOPs", c["total_flops"])
    section(f"TIME on {plan['inputs']['gpus']} × {t['accelerator']} ({plan['inputs']['dtype']})")
    for key, label in (
        ("peak_flops_per_gpu", "peak per device"),
        ("mfu", "MFU"),
        ("cluster_flops", "achieved, all GPUs"),
        ("tokens_per_second", "throughput"),
        ("wall_clock", "wall clock"),
        ("gpu_hours", "GPU-hours"),
    ):
        row(label, t[key])

    section(f"MEMORY PER GPU: model states, {mem['layout']} layout, 16 bytes/parameter")
    lines.append(f"  ({mem['layout_note']}; R = {plan['inputs']['gpus']} data-parallel ranks)")
    lines.append(f"  {'':<12}{'weights':>12}{'gradients':>12}{'optimizer':>12}{'total':>12}")
    for sharding, st in mem["model_states"].items():
        cells = "".join(f"{fmt(st[k]):>12}" for k in ("weights", "gradients", "optimizer"))
        formula = " + ".join(st[k]["formula"] for k in ("weights", "gradients", "optimizer"))
        lines.append(f"  {SHARDING_LABELS[sharding]:<12}{cells}{fmt(st['total']):>12}   {formula}")
    inputs = plan["inputs"]
    lines.append(
        f"  activations per layer (Korthikanti et al. 2022), micro batch {inputs['micro_batch']}"
        f" × {inputs['seq_len']} tokens,"
    )
    lines.append(f"  {mem['activation_note']}:")
    for mode, item in mem["activations_per_layer"].items():
        row(f"  recompute {mode}", item)
    row("  output layer + loss", mem["output_layer"])
    lines.append("  backward working set (built while the backward pass runs):")
    for mode, item in mem["backward_transient"].items():
        row(f"  recompute {mode}", item)
    if inputs["attention"] == "flash":
        lines += [
            "    (flash attention recomputes the a·s² scores inside its backward: 'none' costs",
            "     what 'selective' costs; --attention materialized --dropout gives the paper's",
            "     s·b·h·(34 + 5·a·s/h))",
        ]
    lines += [
        f"  what fits in {fmt(mem['usable_memory'])}, {mem['usable_memory']['formula']} of "
        f"{fmt(mem['device_memory'])}:",
        f"    {mem['fits_formula']}",
    ]
    modes = list(mem["activations_per_layer"])
    lines.append(f"  {'':<12}" + "".join(f"{'recompute ' + mode:>22}" for mode in modes))
    for sharding, by_mode in mem["fits"].items():
        cells = "".join(
            f"{('fits ' if x['fits'] else 'NO ') + fmt(q(x['bytes'], 'B', '')):>22}"
            for x in by_mode.values()
        )
        lines.append(f"  {SHARDING_LABELS[sharding]:<12}{cells}")

    section("BATCH")
    for key, label in (
        ("global_batch", "global batch"),
        ("global_batch_tokens", "tokens per step"),
        ("step_time", "step time"),
        ("max_data_parallel", "max useful DP degree"),
        ("grad_accumulation", "grad accumulation"),
    ):
        row(label, b[key])
    crit = b["critical_batch_prior"]
    priors = ", ".join(f"{k}: {fmt(q(v, 'tokens', ''))}" for k, v in crit["tokens_at_loss"].items())
    lines += [
        "  critical batch prior at a loss (nats/token) of",
        f"    {priors}",
        f"    {crit['formula']}",
        f"  this batch is the prior's B_crit at a loss of {crit['loss_where_critical']:.2f} nats;"
        " above that loss",
        "    (early in training) it is larger than critical and more data parallelism buys less",
        "    than linear speed-up (McCandlish et al. 2018: B_crit ≈ B_noise = tr(Σ)/|G|², which",
        "    grows as the loss falls; the trainer measures B_simple online: compare the two)",
    ]
    lines += [f"  WARNING: {w}" for w in b["warnings"]]
    return "\n".join(lines)
