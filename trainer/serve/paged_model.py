"""One engine step through trainer.model.Transformer with a paged KV cache.

Every scheduled sequence contributes a run of new tokens (a prefill chunk, or one token when
decoding); the runs are packed into one row, so the projections and the MLP of all sequences
are one matmul each: that is where batching pays. Attention is per sequence: its queries, and
its whole context gathered from the block pool (kv_cache.py), padded to the step's longest.
The model's own modules (norms, projections, rotary tables, MLP) do the arithmetic, so the
numbers are the `generate` job's up to float rounding. A VLM's image positions take the
projected image vectors as their input instead of token embeddings (trainer/vlm/model.py's
layout: the image first, then the text), and are cached in blocks like any position.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.model import Transformer
from trainer.serve.kv_cache import PagedKVCache


@dataclass
class Run:
    """New tokens of one sequence in a step: `tokens` at positions start.. of `table`."""

    tokens: list[int]
    start: int
    table: list[int]
    image: torch.Tensor | None = None  # input vectors of the run's first positions (a VLM's)


class StepBatch:
    """The index tensors of one step, built once and shared by every layer."""

    def __init__(self, runs: list[Run], cache: PagedKVCache, device):
        bs = cache.block_size
        starts = torch.tensor([r.start for r in runs])
        lengths = torch.tensor([len(r.tokens) for r in runs])
        contexts = starts + lengths
        batch, max_new, max_ctx = len(runs), int(lengths.max()), int(contexts.max())
        tables = torch.zeros(batch, -(-max_ctx // bs), dtype=torch.long)
        for i, r in enumerate(runs):
            tables[i, : len(r.table)] = torch.tensor(r.table[: tables.shape[1]])
        key = torch.arange(max_ctx)
        # Pool slot of every context position of every run (padding points at some slot).
        context_slots = tables[:, key // bs] * bs + key % bs
        # Where each packed token sits in the padded (batch, max_new) query grid.
        self.row = torch.repeat_interleave(torch.arange(batch), lengths)
        self.col = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
            lengths.cumsum(0) - lengths, lengths
        )
        positions = starts[self.row] + self.col
        self.ids = torch.tensor([t for r in runs for t in r.tokens], device=device)[None]
        self.positions = positions.to(device)[None]
        self.slots = context_slots[self.row, positions].to(device)
        # Query j of a run sits at position start + j and sees keys 0..start + j.
        query = torch.arange(max_new)
        mask = key[None, None, :] <= starts[:, None, None] + query[None, :, None]
        mask &= query[None, :, None] < lengths[:, None, None]
        mask[:, :, 0] |= ~mask.any(dim=-1)  # padded query rows see one key: no NaN rows
        self.context_slots = context_slots.to(device)
        self.mask = mask[:, None].to(device)
        self.row, self.col = self.row.to(device), self.col.to(device)
        self.shape = (batch, max_new)
        self.last = (lengths.cumsum(0) - 1).to(device)  # each run's last token
        # Image positions of the packed row, and their vectors (which replace the embeddings
        # of the placeholder ids there).
        offsets = (lengths.cumsum(0) - lengths).tolist()
        images = [(o, r.image) for o, r in zip(offsets, runs, strict=True) if r.image is not None]
        self.image_at = torch.tensor(
            [o + j for o, image in images for j in range(len(image))], device=device
        )
        self.image = torch.cat([image for _, image in images]) if images else None


def _attention(attn, x, cos, sin, step: StepBatch, cache: PagedKVCache, layer: int):
    n = x.shape[1]
    q = attn.wq(x).view(1, n, attn.n_heads, attn.head_dim)
    k = attn.wk(x).view(1, n, attn.n_kv_heads, attn.head_dim)
    v = attn.wv(x).view(1, n, attn.n_kv_heads, attn.head_dim)
    q, k = attn.ops.apply_rope(q, k, cos, sin)
    cache.write(layer, step.slots, k[0], v[0])
    keys, values = cache.gather(layer, step.context_slots)
    padded = q.new_zeros(*step.shape, attn.n_heads, attn.head_dim)
    padded[step.row, step.col] = q[0]
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=step.mask,
        enable_gqa=attn.n_kv_heads != attn.n_heads,
    ).transpose(1, 2)
    return attn.wo(out[step.row, step.col].reshape(1, n, -1))


@torch.no_grad()
def forward_step(model: Transformer, runs: list[Run], cache: PagedKVCache) -> torch.Tensor:
    """Logits (len(runs), vocab) at the last new token of each run; the runs' keys and values
    are written into `cache` (their tables must already hold the positions)."""
    device = next(model.parameters()).device
    step = StepBatch(runs, cache, device)
    cos, sin = model.rope.cos_sin(step.positions)
    x = model.tok_embeddings(step.ids)
    if step.image is not None:
        x[0, step.image_at] = step.image.to(x.dtype)
    for i, block in enumerate(model.layers):
        h = x + _attention(block.attention, block.attention_norm(x), cos, sin, step, cache, i)
        x = h + block.feed_forward(block.ffn_norm(h))
    last = model.norm(x)[0, step.last]
    return F.linear(last, model.output.weight).float()
