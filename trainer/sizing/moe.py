"""Mixture-of-experts arithmetic: total vs active parameters, expert memory, all-to-all bytes.

A MoE layer holds E routed experts (SwiGLU, width f_e: 3·d·f_e each), S shared experts of the
same width, and a router (d·E); a token uses k routed experts and the shared ones. So:

    total  = embeddings + L·attention + dense layers·3·d·f + MoE layers·((E + S)·3·d·f_e + d·E)
    active = embeddings + L·attention + dense layers·3·d·f + MoE layers·((k + S)·3·d·f_e + d·E)

FLOPs per token use the active non-embedding parameters in `flops.flops_per_token` (the one
formula the trainer's MFU uses too: Transformer.matmul_params() counts k of E experts). Quoting
MFU against total parameters overstates it by total/active (3.6× for Mixtral, 18× for
DeepSeek-V3). Memory holds every expert: with expert parallelism over P ranks each rank keeps
1/P of the routed experts and all the rest.

All-to-all, per MoE layer and token: the k routed copies of its hidden vector (d elements of e
bytes) go to their experts and come back, forward and again backward: 4·k·d·e bytes, of which
(P − 1)/P leave the rank.

Published shapes reproduced here (test): Mixtral 8x7B (46.7B total, 12.9B active),
DeepSeek-V3 (671B, 37B; multi-head latent attention, 3 dense layers first, 1 shared expert;
the 14B multi-token-prediction module is not part of the 671B) and Qwen3-30B-A3B (30.53B,
3.35B; heads wider than dim / heads).
"""

from dataclasses import dataclass

from trainer.sizing.params import llama_param_count
from trainer.sizing.report import Quantity, q


@dataclass(frozen=True)
class MoESpec:
    experts: int  # routed experts E per MoE layer
    top_k: int  # routed experts per token
    expert_ffn_dim: int  # one expert's SwiGLU width f_e
    shared_experts: int = 0
    moe_every: int = 1  # Kitchen's rule: layer i (from 0) is MoE when (i + 1) % moe_every == 0
    first_dense: int = 0  # the first layers stay dense (DeepSeek-V3: 3)

    def moe_layers(self, n_layers: int) -> int:
        return sum(1 for i in range(self.first_dense, n_layers) if (i + 1) % self.moe_every == 0)


@dataclass(frozen=True)
class MoEParamCount:
    embedding: int
    output: int  # 0 when tied to the embedding
    attention: int  # all layers, with the norms
    dense_mlp: int  # all dense layers
    routed: int  # all routed experts of all MoE layers
    routed_active: int  # the k of E a token uses
    shared: int  # shared experts, all MoE layers
    router: int
    final_norm: int  # elementwise: in the total, not in N

    @property
    def total(self) -> int:
        blocks = self.non_embedding_total - self.output_matmul
        return self.embedding + self.output + blocks + self.final_norm

    @property
    def output_matmul(self) -> int:
        """The output projection's weights (the embedding's when tied): a matmul either way."""
        return self.output or self.embedding

    @property
    def non_embedding_total(self) -> int:
        blocks = self.attention + self.dense_mlp + self.routed + self.shared + self.router
        return blocks + self.output_matmul

    @property
    def non_embedding_active(self) -> int:
        """N of 6·N: what a token multiplies by (Transformer.matmul_params() for Kitchen's)."""
        return self.non_embedding_total - self.routed + self.routed_active

    @property
    def active(self) -> int:
        return self.total - self.routed + self.routed_active

    def per_rank(self, expert_parallel: int) -> float:
        """Parameters one rank holds when the routed experts are split over `expert_parallel`."""
        return self.total - self.routed + self.routed / expert_parallel


def gqa_attention_params(dim: int, heads: int, kv_heads: int, head_dim: int = 0) -> int:
    """Llama attention (q, k, v, o) and the block's two norms, as trainer/sizing/params.py
    (`head_dim` 0: dim / heads)."""
    return llama_param_count(dim, 1, heads, kv_heads, 0, 0, True, head_dim).per_layer


def mla_attention_params(
    dim: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v_dim: int
) -> int:
    """DeepSeek's multi-head latent attention: low-rank q and kv projections with their norms,
    the decoupled rotary key, the output projection, and the block's two norms."""
    q = dim * q_rank + q_rank + q_rank * heads * (nope + rope)
    kv = dim * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * dim + 2 * dim


def moe_param_count(
    *,
    dim: int,
    n_layers: int,
    vocab: int,
    tie_embeddings: bool,
    dense_ffn_dim: int,
    attention_per_layer: int,
    spec: MoESpec,
) -> MoEParamCount:
    n_moe = spec.moe_layers(n_layers)
    expert = 3 * dim * spec.expert_ffn_dim
    return MoEParamCount(
        embedding=vocab * dim,
        output=0 if tie_embeddings else vocab * dim,
        attention=n_layers * attention_per_layer,
        dense_mlp=(n_layers - n_moe) * 3 * dim * dense_ffn_dim,
        routed=n_moe * spec.experts * expert,
        routed_active=n_moe * spec.top_k * expert,
        shared=n_moe * spec.shared_experts * expert,
        router=n_moe * dim * spec.experts,
        final_norm=dim,
    )


@dataclass(frozen=True)
class MoEPreset:
    shape: dict  # plan.py's shape keys: layers, dim, heads, kv_heads, ffn_dim (dense), vocab
    spec: MoESpec
    attention_per_layer: int | None = None  # None: grouped-query attention from the shape


PRESETS = {
    # Mistral AI, "Mixtral of Experts" (2024), and its config.json.
    "mixtral-8x7b": MoEPreset(
        shape=dict(layers=32, dim=4096, heads=32, kv_heads=8, ffn_dim=14336, vocab=32000),
        spec=MoESpec(experts=8, top_k=2, expert_ffn_dim=14336),
    ),
    # DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), and its config.json.
    "deepseek-v3": MoEPreset(
        shape=dict(layers=61, dim=7168, heads=128, kv_heads=128, ffn_dim=18432, vocab=129280),
        spec=MoESpec(experts=256, top_k=8, expert_ffn_dim=2048, shared_experts=1, first_dense=3),
        attention_per_layer=mla_attention_params(7168, 128, 1536, 512, 128, 64, 128),
    ),
    # Qwen team, "Qwen3 Technical Report" (2025), and Qwen3-30B-A3B's config.json: heads of
    # 128 on dim 2048 (not 2048/32 = 64), every layer MoE (its intermediate_size 6144 unused).
    # Its per-head q/k RMSNorm weights (48 · 2 · 128) are left out, as Kitchen has none.
    "qwen3-30b-a3b": MoEPreset(
        shape=dict(
            layers=48, dim=2048, heads=32, kv_heads=4, head_dim=128, ffn_dim=6144, vocab=151936
        ),
        spec=MoESpec(experts=128, top_k=8, expert_ffn_dim=768),
    ),
}


@dataclass(frozen=True)
class MoESection:
    experts: str  # "8 routed (top-2) + 0 shared, SwiGLU 14336, 32 of 32 layers"
    total: Quantity
    active: Quantity
    active_share: Quantity
    routed_experts: Quantity
    params_per_rank: Quantity
    all_to_all_per_step: Quantity
    mfu_if_quoted_on_total: Quantity


def section(
    count: MoEParamCount,
    spec: MoESpec,
    n_layers: int,
    dim: int,
    *,
    expert_parallel: int,
    bytes_per_element: int,
    tokens_per_rank_per_step: float,
    mfu: float,
) -> MoESection:
    n_moe, P, k = spec.moe_layers(n_layers), expert_parallel, spec.top_k
    leaving = (P - 1) / P
    a2a = n_moe * 4 * k * dim * bytes_per_element * tokens_per_rank_per_step * leaving
    return MoESection(
        experts=f"{spec.experts} routed (top-{k}) + {spec.shared_experts} shared, SwiGLU "
        f"{spec.expert_ffn_dim}, {n_moe} of {n_layers} layers",
        total=q(count.total, "params", "embeddings + attention + dense MLPs + all experts"),
        active=q(count.active, "params", "the same with k of E routed experts"),
        active_share=q(count.active / count.total, "fraction", "active / total"),
        routed_experts=q(count.routed, "params", "MoE layers · E · 3·d·f_e"),
        params_per_rank=q(
            count.per_rank(P), "params", f"total − routed + routed/P (P = {P} expert-parallel)"
        ),
        all_to_all_per_step=q(
            a2a,
            "B",
            "MoE layers · 4·k·d·e · tokens per rank · (P − 1)/P (dispatch, combine, ×2 bwd)",
        ),
        mfu_if_quoted_on_total=q(
            mfu * count.non_embedding_total / count.non_embedding_active,
            "fraction",
            "the assumed MFU × total/active: the inflated figure (FLOPs use active N)",
        ),
    )
