"""One engine step through trainer.model.Transformer with a paged KV cache.

Every scheduled sequence contributes a run of new tokens (a prefill chunk, or one token when
decoding); the runs are packed into one row, so the projections and the MLP of all sequences
are one matmul each: that is where batching pays. Attention is per sequence, over its context
gathered block by block from the pool (kv_cache.py), in two groups: the runs of one new token
(decoding: one query each, no padding) and the longer runs (prefill chunks: queries padded to
the longest chunk). Kept apart, a prefill chunk arriving does not pad every decoding sequence's
single query up to its own length. The model's own modules (norms, projections, rotary tables,
MLP) do the arithmetic, so the numbers are the `generate` job's up to float rounding. A VLM's
image positions take the projected image vectors as their input instead of token embeddings
(trainer/vlm/model.py's layout: the image first, then the text), and are cached in blocks like
any position.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.inference.kv_cache import PagedKVCache
from trainer.model import Transformer


@dataclass
class Run:
    """New tokens of one sequence in a step: `tokens` at positions start.. of `table`."""

    tokens: list[int]
    start: int
    table: list[int]
    image: torch.Tensor | None = None  # input vectors of the run's first positions (a VLM's)
    logits: int = 1  # logits of this many of its last positions (a speculative draft's: all)


class _Group:
    """Attention inputs of runs packed one after another from token `first` of the step's row.

    Query j of a run sits at position start + j and sees keys 0..start + j; keys are the whole
    blocks of the run's table, padded to the group's longest with block 0 and masked out."""

    def __init__(self, runs: list[Run], first: int, cache: PagedKVCache, device):
        starts = torch.tensor([r.start for r in runs])
        lengths = [len(r.tokens) for r in runs]
        blocks = max(len(r.table) for r in runs)
        tables = [r.table + [0] * (blocks - len(r.table)) for r in runs]
        self.tables = torch.tensor(tables, device=device)
        self.tokens = slice(first, first + sum(lengths))
        key = torch.arange(blocks * cache.block_size)
        max_new = max(lengths)
        self.shape = (len(runs), max_new)
        self.row = self.col = None  # decoding: one query per run, nothing to pad
        if max_new == 1:
            self.mask = _additive((key[None, :] <= starts[:, None])[:, None, None], cache, device)
            return
        counts = torch.tensor(lengths)
        query = torch.arange(max_new)
        mask = key[None, None, :] <= starts[:, None, None] + query[None, :, None]
        mask &= query[None, :, None] < counts[:, None, None]
        mask[:, :, 0] |= ~mask.any(dim=-1)  # padded query rows see one key: no NaN rows
        self.mask = _additive(mask[:, None], cache, device)
        # Where each packed token sits in the padded (runs, max_new) query grid.
        self.row = torch.repeat_interleave(torch.arange(len(runs)), counts).to(device)
        offsets = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        self.col = (torch.arange(int(counts.sum())) - offsets).to(device)


def _additive(allowed: torch.Tensor, cache: PagedKVCache, device) -> torch.Tensor:
    """A boolean attention mask as the additive one attention makes of it (0 or -inf), made
    once a step here rather than once a layer inside scaled_dot_product_attention."""
    mask = torch.zeros(allowed.shape, dtype=cache.dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


class StepBatch:
    """The index tensors of one step, built once and shared by every layer."""

    def __init__(self, runs: list[Run], cache: PagedKVCache, device):
        decoding = [r for r in runs if len(r.tokens) == 1]
        prefill = [r for r in runs if len(r.tokens) > 1]
        packed = decoding + prefill  # the order of the step's row
        # A decoding run's one position is written out here, not through cache.slots: this
        # loop runs once per request per step.
        bs = cache.block_size
        ids = [r.tokens[0] for r in decoding]
        positions = [r.start for r in decoding]
        slots = [r.table[r.start // bs] * bs + r.start % bs for r in decoding]
        for r in prefill:
            ids += r.tokens
            positions += range(r.start, r.start + len(r.tokens))
            slots += cache.slots(r.table, r.start, r.start + len(r.tokens))
        self.ids = torch.tensor(ids, device=device)[None]
        self.positions = torch.tensor(positions, device=device)[None]
        self.slots = torch.tensor(slots, device=device)
        self.groups = []
        if decoding:
            self.groups.append(_Group(decoding, 0, cache, device))
        if prefill:
            self.groups.append(_Group(prefill, len(decoding), cache, device))
        # Each run's last token in the packed row (in the order of `runs`), and a VLM's image
        # positions in the row with their vectors, which replace the embeddings of the
        # placeholder ids there (None in a step without images).
        end, last = 0, {}
        at: list[int] = []
        images: list[torch.Tensor] = []
        for r in packed:
            if r.image is not None:
                at.extend(range(end, end + len(r.image)))
                images.append(r.image)
            end += len(r.tokens)
            last[id(r)] = end
        rows = [i for r in runs for i in range(last[id(r)] - r.logits, last[id(r)])]
        self.last = torch.tensor(rows, device=device)
        self.image = torch.cat(images) if images else None
        self.image_at = torch.tensor(at, dtype=torch.long, device=device) if images else None


def _attention(attn, x, cos, sin, step: StepBatch, cache: PagedKVCache, layer: int):
    n = x.shape[1]
    q = attn.wq(x).view(1, n, attn.n_heads, attn.head_dim)
    k = attn.wk(x).view(1, n, attn.n_kv_heads, attn.head_dim)
    v = attn.wv(x).view(1, n, attn.n_kv_heads, attn.head_dim)
    q, k = attn.ops.apply_rope(q, k, cos, sin)
    cache.write(layer, step.slots, k[0], v[0])
    outs = []
    for g in step.groups:
        keys, values = cache.gather(layer, g.tables)
        queries = q[0, g.tokens]
        if g.row is None:
            padded = queries[:, None]
        else:
            padded = queries.new_zeros(*g.shape, attn.n_heads, attn.head_dim)
            padded[g.row, g.col] = queries
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=g.mask,
            enable_gqa=attn.n_kv_heads != attn.n_heads,
        ).transpose(1, 2)
        outs.append(out[:, 0] if g.row is None else out[g.row, g.col])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return attn.wo(out.reshape(1, n, -1))


@torch.no_grad()
def forward_step(model: Transformer, runs: list[Run], cache: PagedKVCache) -> torch.Tensor:
    """Logits (sum of the runs' `logits`, vocab) at the last new token of each run (its last
    `logits` tokens), in run order; the runs' keys and values are written into `cache` (their
    tables must already hold the positions)."""
    device = next(model.parameters()).device
    step = StepBatch(runs, cache, device)
    cos, sin = model.rope.cos_sin(step.positions)
    x = model.tok_embeddings(step.ids)
    if step.image is not None:
        x[0, step.image_at] = step.image.to(x.dtype)
    for i, block in enumerate(model.layers):
        h = x + _attention(block.attention, block.attention_norm(x), cos, sin, step, cache, i)
        x = h + block.feed_forward(block.ffn_norm(h))
    last = model.norm(x)[0].index_select(0, step.last)
    return F.linear(last, model.output.weight).float()
