"""Parameter counts of a Llama-style decoder from its shape (the Kitchen trainer's model).

Per layer: attention q and o projections d·(H·Q) each, k and v d·(KVH·Q) each (H heads of
width Q, d/H unless a model says otherwise; grouped-query attention shares KVH < H key/value
heads), SwiGLU MLP 3·d·f (gate, up, down), two RMSNorm
weights d each; no biases. Around the layers: token embedding V·d, final norm d, output
projection V·d (the embedding matrix itself when tied).
"""

from dataclasses import dataclass

from protos.defaults import ffn_dim_for


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # input token table: a lookup, no FLOPs
    per_layer: int
    n_layers: int
    final_norm: int
    output: int  # the projection onto the vocabulary: a real matmul, tied or not
    tied: bool

    @property
    def total(self) -> int:
        """Distinct parameters (what the optimizer holds)."""
        return (
            self.embedding
            + self.n_layers * self.per_layer
            + self.final_norm
            + (0 if self.tied else self.output)
        )

    @property
    def non_embedding(self) -> int:
        """N in flops.flops_per_token: the blocks and the output projection (a matmul even when
        tied), as torchtitan and the trainer's Transformer.matmul_params() count it; the input
        table is a lookup and the final norm is elementwise."""
        return self.n_layers * self.per_layer + self.output


def llama_param_count(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab: int,
    tie_embeddings: bool,
    head_dim: int = 0,
) -> ParamCount:
    """`head_dim` 0: dim / n_heads."""
    head_dim = head_dim or dim // n_heads
    attention = 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim
    mlp = 3 * dim * ffn_dim
    norms = 2 * dim
    return ParamCount(
        embedding=vocab * dim,
        per_layer=attention + mlp + norms,
        n_layers=n_layers,
        final_norm=dim,
        output=vocab * dim,
        tied=tie_embeddings,
    )


def vision_matmul_params(
    image_size: int, patch_size: int, dim: int, n_layers: int, pixel_shuffle: int, lm_dim: int
) -> tuple[int, int]:
    """(encoder, projector) weights used in matmuls of Kitchen's VLM (trainer/vlm, #16).

    Encoder per block: qkv 3·d² and output d² projections, SwiGLU 3·d·f, two norms 2·d (counted
    as the decoder's `per_layer` counts them); plus the patch embedding 3·p²·d (a strided
    convolution: one matmul per patch). Projector: pixel shuffle
    makes r²·d inputs per image token, then r²·d·D and D·D (D the language model's width).
    """
    f = ffn_dim_for(dim)
    encoder = n_layers * (4 * dim * dim + 3 * dim * f + 2 * dim) + 3 * patch_size * patch_size * dim
    projector = dim * pixel_shuffle * pixel_shuffle * lm_dim + lm_dim * lm_dim
    return encoder, projector
