"""plan: the arithmetic to do before a training run, each number with the formula behind it.

    ./bazel run //trainer:plan -- --preset llama3-8b --tokens 1T --seq-len 8192 --gpu H200 --gpus 64
    ./bazel run //trainer:plan -- --layers 16 --dim 2048 --heads 16 --vocab 32000 --tokens 20B
    ./bazel run //trainer:plan -- --layers 4 --dim 256 --heads 8 --vocab 4096 --gpu cpu --gpus 1

It prints total training FLOPs, wall-clock time and GPU-hours at an assumed MFU, memory per GPU
under DDP and ZeRO-1/2/3 sharding, activation memory per recomputation mode, what fits on the
chosen accelerator, and batch-size guidance. `--json` prints the same numbers for machines. The
formulas live in trainer/sizing/{flops,memory,batch,params}.py, which the trainer imports too.
"""

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from protos.defaults import SECTIONS, ffn_dim_for
from trainer.sizing import batch, flops, memory, plan_memory, plan_moe, plan_vision
from trainer.sizing import moe as moe_sizing
from trainer.sizing.accelerators import ACCELERATORS, match_accelerator
from trainer.sizing.comm import ModelShape
from trainer.sizing.params import llama_param_count
from trainer.sizing.plan_flags import PlanError, count
from trainer.sizing.precision import SPECS, Precision, default_precision, from_config_dtype
from trainer.sizing.report import (
    BatchSection,
    ComputeSection,
    CriticalBatchPrior,
    ModelSection,
    Plan,
    TimeSection,
    q,
    render,
)

GIB = memory.GIB
PRESETS = {  # public shapes, so that a plan for a known model needs no shape flags
    "llama2-7b": dict(layers=32, dim=4096, heads=32, kv_heads=32, ffn_dim=11008, vocab=32000),
    "llama3-8b": dict(layers=32, dim=4096, heads=32, kv_heads=8, ffn_dim=14336, vocab=128256),
    "llama3-70b": dict(layers=80, dim=8192, heads=64, kv_heads=8, ffn_dim=28672, vocab=128256),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    m = p.add_argument_group("model (a --preset, or the shape flags)")
    m.add_argument(
        "--preset",
        choices=sorted(PRESETS) + sorted(moe_sizing.PRESETS),
        help="a known public model shape",
    )
    m.add_argument("--layers", type=int, help="transformer layers L")
    m.add_argument("--dim", type=int, help="hidden size d")
    m.add_argument("--heads", type=int, help="attention heads H")
    m.add_argument("--head-dim", type=int, help="one head's width Q (default: d/H)")
    m.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    m.add_argument("--ffn-dim", type=int, help="SwiGLU width (default: the trainer's 8/3·d)")
    m.add_argument("--vocab", type=int, help="vocabulary size V")
    m.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        help="output projection shares the embedding (default: the trainer's default; "
        "presets are untied)",
    )
    m.add_argument("--params", type=count, help="total parameters, overriding the shape's count")
    r = p.add_argument_group("run")
    r.add_argument("--tokens", type=count, help="training tokens (default: 20 per parameter)")
    r.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence T (2048)")
    r.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per pass (1)")
    r.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default: ~1M tokens)"
    )
    h = p.add_argument_group("hardware")
    h.add_argument(
        "--gpu",
        default="H100-SXM",
        help=f"accelerator: {', '.join(ACCELERATORS)}, a device name such as 'NVIDIA H200', "
        "or cpu (this machine, measured) (H100-SXM)",
    )
    h.add_argument("--gpus", type=int, default=8, help="how many (data parallel) (8)")
    h.add_argument("--mfu", type=float, default=0.4, help="assumed MFU, a fraction (0.4)")
    h.add_argument("--peak-tflops", type=float, help="peak for an accelerator not in the table")
    h.add_argument("--memory-gib", type=float, help="memory for an accelerator not in the table")
    h.add_argument(
        "--dtype",
        choices=[p.value for p in Precision],
        help="training precision: fp32; bf16 or fp16 autocast (fp32 master weights; fp16 "
        "loss-scaled); fp8 (float8 matmuls, trainer/fp8.py) (default: --config's train.dtype, else "
        "bf16; fp32 on cpu; trainer/sizing/precision.py)",
    )
    h.add_argument(
        "--config",
        help="a job YAML (launcher/submit's): its trainer.train.dtype is the precision "
        "unless --dtype is given",
    )
    h.add_argument(
        "--attention",
        choices=["flash", "materialized"],
        help="flash: the a·s² scores are never stored (SDPA on a GPU, the default there); "
        "materialized: they are (the default on cpu, and Korthikanti et al.'s case)",
    )
    h.add_argument(
        "--dropout",
        action="store_true",
        help="count dropout masks, as Korthikanti et al. do (Kitchen's model has no dropout)",
    )
    plan_moe.add_flags(p)
    plan_vision.add_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--layouts",
        action="store_true",
        help="also cost every TP/PP/CP/DP layout of --gpus and recommend one "
        "(trainer/sizing/recommend.py)",
    )
    return p


def layout_costs(plan: Plan, a: argparse.Namespace):
    """(costs fastest first, the recommendation, why) for the layouts of `a.gpus`."""
    from trainer.sizing import recommend

    gb = int(plan.batch.global_batch.value or 1)
    costs = recommend.candidates(
        plan.model.shape,
        a.gpus,
        a.seq_len,
        global_batch=gb,
        step_flops=float(plan.compute.flops_per_token.value or 0) * gb * a.seq_len,
        peak_flops=float(plan.time.peak_flops_per_gpu.value or 0),
        mfu=a.mfu,
        memory_gib=float(plan.memory.device_memory.value or 0) / GIB,
        precision=Precision(a.dtype),
    )
    return (costs, *recommend.recommend(costs))


def _shape(a: argparse.Namespace) -> ModelShape:
    preset = PRESETS.get(a.preset) or (a.preset and moe_sizing.PRESETS[a.preset].shape)
    shape: dict[str, Any] = dict(preset) if preset else {}
    shape["tie_embeddings"] = False if a.preset else SECTIONS["model"]["tie_embeddings"].default
    keys = ("layers", "dim", "heads", "kv_heads", "head_dim", "ffn_dim", "vocab", "tie_embeddings")
    for key in keys:
        if getattr(a, key) is not None:
            shape[key] = getattr(a, key)
    for key in ("layers", "dim", "heads", "vocab"):
        flag = "--" + key.replace("_", "-")
        if key not in shape:
            raise PlanError(f"{flag}: required (or give --preset)")
        if shape[key] <= 0:
            raise PlanError(f"{flag}: {shape[key]} must be positive")
    shape.setdefault("kv_heads", shape["heads"])
    shape.setdefault("ffn_dim", ffn_dim_for(shape["dim"]))
    if "head_dim" not in shape and shape["dim"] % shape["heads"]:
        raise PlanError(
            f"--heads: {shape['heads']} does not divide --dim {shape['dim']} (or give --head-dim)"
        )
    shape.setdefault("head_dim", shape["dim"] // shape["heads"])
    if shape["head_dim"] <= 0:
        raise PlanError(f"--head-dim: {shape['head_dim']} must be positive")
    if shape["kv_heads"] <= 0 or shape["heads"] % shape["kv_heads"]:
        raise PlanError(f"--kv-heads: {shape['kv_heads']} does not divide --heads {shape['heads']}")
    if shape["ffn_dim"] <= 0:
        raise PlanError(f"--ffn-dim: {shape['ffn_dim']} must be positive")
    return ModelShape(**shape)


def _hardware(a: argparse.Namespace) -> tuple[str, float, str, float]:
    """(name, peak FLOP/s, basis, memory GiB) of one accelerator."""
    if a.gpu.lower() == "cpu":
        peak, basis = flops.peak_flops_per_second("cpu", _peak_dtype(a))
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        name, mem = "cpu", ram
    else:
        known = match_accelerator(a.gpu)
        if known is None and (a.peak_tflops is None or a.memory_gib is None):
            raise PlanError(
                f"--gpu: {a.gpu!r} is not in the table ({', '.join(ACCELERATORS)}); "
                "give --peak-tflops and --memory-gib for it"
            )
        name = known.key if known else a.gpu
        if a.dtype == "fp32" and a.peak_tflops is None:
            raise PlanError("--peak-tflops: required with --dtype fp32 (the table is bf16)")
        peak, basis = (known.bf16_dense_flops, f"table:{known.key}") if known else (0.0, "")
        mem = known.memory_gib if known else 0.0
    if a.peak_tflops is not None:
        if a.peak_tflops <= 0:
            raise PlanError(f"--peak-tflops: {a.peak_tflops:g} must be positive")
        peak, basis = a.peak_tflops * 1e12, "given (--peak-tflops)"
    if a.memory_gib is not None:
        if a.memory_gib <= 0:
            raise PlanError(f"--memory-gib: {a.memory_gib:g} must be positive")
        mem = a.memory_gib
    return name, peak, basis, mem


def make_plan(a: argparse.Namespace) -> Plan:
    """All numbers of the plan, each a Quantity (value, unit, formula), grouped in sections.
    Fills in `a.dtype` and `a.attention` where they were left to their defaults."""
    for flag in ("seq_len", "micro_batch", "gpus"):
        if getattr(a, flag) <= 0:
            raise PlanError(f"--{flag.replace('_', '-')}: {getattr(a, flag)} must be positive")
    if not 0 < a.mfu <= 1:
        hint = f" (did you mean {a.mfu / 100:g}?)" if 1 < a.mfu <= 100 else ""
        raise PlanError(f"--mfu: {a.mfu:g} is not a fraction in (0, 1]{hint}")
    on_cpu = a.gpu.lower() == "cpu"
    a.dtype = a.dtype or _config_precision(a.config, on_cuda=not on_cpu).value
    a.attention = a.attention or ("materialized" if on_cpu else "flash")
    s = _shape(a)
    L, d, H, V, T, Q = s.layers, s.dim, s.heads, s.vocab, a.seq_len, s.head_dim
    pc = llama_param_count(d, L, H, s.kv_heads, s.ffn_dim, V, s.tie_embeddings, Q)
    experts = plan_moe.experts(a, s)  # None for a dense model
    total = int(a.params) if a.params else (experts.total if experts else pc.total)
    n = total - (0 if s.tie_embeddings else V * d) - d if a.params else pc.non_embedding
    if experts and not a.params:
        n = experts.non_embedding_active  # FLOPs follow the active experts
    if n <= 0:
        raise PlanError(f"--params: {total} is not more than the embedding's V·d = {V * d}")
    tokens = a.tokens or 20.0 * total
    tokens_basis = "given (--tokens)" if a.tokens else "20 × parameters (Chinchilla-optimal)"
    model = ModelSection(
        shape=s,
        parameters=q(
            total,
            "params",
            "given (--params)"
            if a.params
            else ("V·d (tied) + L·layer + d" if s.tie_embeddings else "2·V·d + L·layer + d"),
        ),
        params_per_layer=q(pc.per_layer, "params", "2·d·H·Q + 2·d·KVH·Q + 3·d·f + 2·d"),
        non_embedding=q(
            n,
            "params",
            "active: blocks with k of E experts + V·d"
            if experts and not a.params
            else "L·layer + V·d (blocks and output projection)",
        ),
    )

    fpt = flops.flops_per_token(n, L, H, Q, T)
    attn = flops.flops_per_token(0, L, H, Q, T)  # the attention term alone
    fpt_formula = "6·N + 12·L·H·Q·T (PaLM app. B; forward + backward)"
    if a.image_size:  # #16: the encoder's FLOPs spread over the sequence the image starts
        fpt = plan_vision.flops_per_row(a, d, fpt, T) / T
        fpt_formula += " + vision FLOPs per image / T (flops.vision_flops_per_image)"
    compute = ComputeSection(
        tokens=q(tokens, "tokens", tokens_basis),
        flops_per_token=q(fpt, "FLOP", fpt_formula),
        attention_share=q(attn / fpt, "fraction", "12·L·H·Q·T / (6·N + 12·L·H·Q·T)"),
        total_flops=q(fpt * tokens, "FLOP", "FLOPs per token × tokens"),
    )

    gpu, peak, basis, mem_gib = _hardware(a)
    cluster = _data_ranks(a, T) * peak * a.mfu
    seconds = fpt * tokens / cluster
    time = TimeSection(
        accelerator=gpu,
        peak_flops_per_gpu=q(peak, "FLOP/s", f"{_peak_dtype(a)} dense peak, basis {basis}"),
        mfu=q(a.mfu, "fraction", "assumed (--mfu)"),
        cluster_flops=q(cluster, "FLOP/s", "GPUs used (≤ micro batches per step) × peak × MFU"),
        tokens_per_second=q(cluster / fpt, "tokens/s", "cluster FLOP/s / FLOPs per token"),
        wall_clock=q(seconds, "s", "total FLOPs / cluster FLOP/s"),
        gpu_hours=q(seconds * a.gpus / 3600, "GPU-h", "wall clock × GPUs"),
    )
    batch_section = _batch(a, T, cluster / fpt, tokens)
    held = experts.per_rank(a.expert_parallel) if experts else total  # every expert is memory
    return Plan(
        inputs=vars(a),
        model=model,
        compute=compute,
        time=time,
        memory=plan_memory.section(
            s,
            Precision(a.dtype),
            held_params=held,
            ranks=_data_ranks(a, T),
            seq_len=T,
            micro_batch=a.micro_batch,
            attention=a.attention,
            dropout=a.dropout,
            memory_gib=mem_gib,
        ),
        batch=batch_section,
        moe=plan_moe.section(
            a, s, experts, batch_section, SPECS[Precision(a.dtype)].activations.element
        ),
    )


def _peak_dtype(a: argparse.Namespace) -> str:
    """The peak MFU is quoted against: fp32's, or the 16-bit dense peak (for fp8 too: MFU
    stays comparable, and a float8 speed-up shows as MFU above the bf16 run's)."""
    return "fp32" if a.dtype == "fp32" else "bf16"


def _config_precision(path: str | None, *, on_cuda: bool) -> Precision:
    """The precision of a job YAML's trainer.train.dtype; the trainer's default without one."""
    if path is None:
        return default_precision(on_cuda)
    from protos.config_yaml import ConfigError, load_job_spec

    try:
        dtype = load_job_spec(path).trainer.train.dtype
        return from_config_dtype(dtype, on_cuda=on_cuda)
    except (ConfigError, OSError, ValueError) as e:
        raise PlanError(f"--config: {path}: {e}") from e


def _global_batch(a: argparse.Namespace, T: int) -> int:
    """Sequences per step: --global-batch, or about 2^20 tokens in whole micro batches."""
    gb = a.global_batch or max(a.micro_batch, round(2**20 / T / a.micro_batch) * a.micro_batch)
    if gb < a.micro_batch:
        raise PlanError(f"--global-batch: {gb} is smaller than --micro-batch {a.micro_batch}")
    return gb


def _data_ranks(a: argparse.Namespace, T: int) -> int:
    """The GPUs data parallelism can use: one micro batch each at least (the rest idle)."""
    return min(a.gpus, batch.max_data_parallel(_global_batch(a, T), a.micro_batch))


def _batch(a: argparse.Namespace, T: int, tokens_per_second: float, budget: float) -> BatchSection:
    gb = _global_batch(a, T)
    gb_tokens = gb * T
    max_dp = batch.max_data_parallel(gb, a.micro_batch)
    accum = batch.grad_accumulation(gb, a.micro_batch, a.gpus)
    priors = {
        f"{loss:g}": batch.kaplan_critical_batch_tokens(loss) for loss in (4.0, 3.0, 2.5, 2.0)
    }
    warnings = []
    if a.gpus > max_dp:
        warnings.append(
            f"{a.gpus} GPUs but only {max_dp} micro batches per step: raise --global-batch or "
            "lower --micro-batch, or the extra GPUs idle"
        )
    elif accum is None:
        warnings.append(
            f"global batch {gb} does not divide into micro batch {a.micro_batch} × {a.gpus} GPUs"
        )
    if gb_tokens > budget:
        warnings.append(f"one step ({gb_tokens:,} tokens) is more than the budget ({budget:,.0f})")
    return BatchSection(
        global_batch=q(gb, "sequences", "given" if a.global_batch else "about 2^20 tokens"),
        global_batch_tokens=q(gb_tokens, "tokens", "global batch × T"),
        step_time=q(gb_tokens / tokens_per_second, "s", "batch tokens / tokens per second"),
        max_data_parallel=q(max_dp, "GPUs", "global batch / micro batch"),
        grad_accumulation=q(accum, "micro batches", "global batch / (micro batch × GPUs)"),
        critical_batch_prior=CriticalBatchPrior(
            tokens_at_loss=priors,
            formula="B_crit(L) ≈ 2e8 tokens · L^(-1/0.21) (Kaplan et al. 2020, WebText2)",
            loss_where_critical=batch.loss_where_critical(gb_tokens),
        ),
        warnings=warnings,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except PlanError as e:
        parser.error(str(e))
    if not args.layouts:
        print(json.dumps(plan.to_json(), indent=2) if args.json else render(plan))
        return 0
    from trainer.sizing import recommend

    costs, best, why = layout_costs(plan, args)
    if args.json:
        out = plan.to_json()
        out["layouts"] = [dataclasses.asdict(c) for c in costs]
        out["recommended"] = {"layout": best.layout.describe() if best else None, "why": why}
        print(json.dumps(out, indent=2, default=str))
    else:
        print(render(plan) + "\n\n" + recommend.render(costs, best, why))
    return 0


if __name__ == "__main__":
    sys.exit(main())
