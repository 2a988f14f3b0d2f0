"""plan's mixture-of-experts flags and their costing (the formulas: trainer/sizing/moe.py)."""

import argparse

from trainer.sizing import moe as moe_sizing
from trainer.sizing.comm import ModelShape
from trainer.sizing.plan_flags import PlanError
from trainer.sizing.report import BatchSection


def add_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("mixture of experts (trainer/sizing/moe.py)")
    e.add_argument("--experts", type=int, help="routed experts per MoE layer (dense if unset)")
    e.add_argument("--top-k", type=int, default=2, help="routed experts per token (2)")
    e.add_argument("--shared-experts", type=int, default=0, help="always-on experts (0)")
    e.add_argument("--expert-ffn-dim", type=int, help="one expert's width (default: --ffn-dim)")
    e.add_argument("--moe-every", type=int, default=1, help="every k-th layer is MoE (1)")
    e.add_argument(
        "--first-dense", type=int, default=0, help="the first layers stay dense (0; DeepSeek-V3 3)"
    )
    e.add_argument("--expert-parallel", type=int, default=1, help="ranks sharing experts (1)")


def spec(a: argparse.Namespace, s: ModelShape) -> moe_sizing.MoESpec | None:
    if a.preset in moe_sizing.PRESETS and a.experts is None:
        return moe_sizing.PRESETS[a.preset].spec
    if a.experts is None:
        return None
    for flag in ("experts", "top_k", "moe_every", "expert_parallel"):
        if getattr(a, flag) <= 0:
            raise PlanError(f"--{flag.replace('_', '-')}: {getattr(a, flag)} must be positive")
    if a.top_k > a.experts:
        raise PlanError(f"--top-k: {a.top_k} is more than --experts {a.experts}")
    if a.shared_experts < 0:
        raise PlanError(f"--shared-experts: {a.shared_experts} must not be negative")
    if a.first_dense < 0:
        raise PlanError(f"--first-dense: {a.first_dense} must not be negative")
    moe_spec = moe_sizing.MoESpec(
        a.experts,
        a.top_k,
        a.expert_ffn_dim or s.ffn_dim,
        a.shared_experts,
        a.moe_every,
        a.first_dense,
    )
    if moe_spec.moe_layers(s.layers) == 0:
        raise PlanError(
            f"--first-dense: {a.first_dense} dense layers first leave no MoE layer of "
            f"{s.layers} (--moe-every {a.moe_every})"
        )
    return moe_spec


def experts(a: argparse.Namespace, s: ModelShape) -> moe_sizing.MoEParamCount | None:
    """The parameter count of a mixture-of-experts model; None for a dense one."""
    moe_spec = spec(a, s)
    if moe_spec is None:
        return None
    if moe_spec.experts % a.expert_parallel:
        raise PlanError(
            f"--expert-parallel: {a.expert_parallel} does not divide {moe_spec.experts}"
        )
    preset = moe_sizing.PRESETS.get(a.preset)
    attention = preset.attention_per_layer if preset and a.experts is None else None
    return moe_sizing.moe_param_count(
        dim=s.dim,
        n_layers=s.layers,
        vocab=s.vocab,
        tie_embeddings=s.tie_embeddings,
        dense_ffn_dim=s.ffn_dim,
        attention_per_layer=attention
        or moe_sizing.gqa_attention_params(s.dim, s.heads, s.kv_heads, s.head_dim),
        spec=moe_spec,
    )


def section(
    a: argparse.Namespace,
    s: ModelShape,
    count: moe_sizing.MoEParamCount | None,
    batch_section: BatchSection,
    bytes_per_element: int,
):
    if count is None:
        return None
    moe_spec = spec(a, s)
    assert moe_spec is not None
    return moe_sizing.section(
        count,
        moe_spec,
        s.layers,
        s.dim,
        expert_parallel=a.expert_parallel,
        bytes_per_element=bytes_per_element,
        tokens_per_rank_per_step=batch_section.global_batch_tokens.value / a.gpus,
        mfu=a.mfu,
    )
