"""Context parallelism: each sequence split across `cp` ranks, keys and values all-gathered.

The sequence is cut into 2·cp chunks and rank r keeps chunks r and 2·cp−1−r: under a causal
mask early queries see few keys and late queries many, so pairing an early chunk with a late
one gives every rank the same attention work (Megatron's and torchtitan's load balancing).

In every attention layer each rank computes queries, keys and values for its own tokens, then
all-gathers the keys and values of the whole sequence (the all-gather flavour of context
parallelism; a ring would overlap the exchange with compute, the bytes are the same). The
backward reduce-scatters their gradients. The mask is built from the global positions of the
local queries and of the gathered keys, with the packed documents' boundaries, so the result
is the single-process attention, row for row.
"""

import torch
import torch.distributed as dist
from torch import nn

from trainer.model import Layout


def token_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions, in the row, of rank `rank`'s tokens: chunks rank and 2cp-1-rank."""
    chunk = seq_len // (2 * cp)
    early = torch.arange(rank * chunk, (rank + 1) * chunk)
    late = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([early, late])


def shard_batch(batch: dict, cp: int, rank: int) -> dict:
    """This rank's tokens of every (B, T) tensor of `batch`; `document_ids` stays whole (the
    mask needs every key's document)."""
    if cp == 1:
        return batch
    idx = token_indices(batch["input_ids"].shape[1], cp, rank)
    return {k: v if k == "document_ids" else v[:, idx] for k, v in batch.items()}


def layout(document_ids: torch.Tensor, cp: int, rank: int, device) -> Layout:
    """The attention mask of this rank's queries (rows) against every rank's keys (columns,
    in the order the all-gather concatenates them). `document_ids` (B, T): the whole rows."""
    T = document_ids.shape[1]
    queries = token_indices(T, cp, rank)
    keys = torch.cat([token_indices(T, cp, r) for r in range(cp)])
    causal = keys[None, :] <= queries[:, None]
    doc = document_ids
    same_document = doc[:, queries, None] == doc[:, None, keys]
    return Layout(mask=(same_document & causal)[:, None].to(device))


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 1; backward: each rank's slice of the gradient, summed over the
    ranks (a reduce-scatter, written as an all-to-all: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        by_owner = grad.transpose(0, 1).contiguous()  # (S_total, B, ...): rank r's is slice r
        received = torch.empty_like(by_owner)
        dist.all_to_all_single(received, by_owner, group=ctx.group)
        mine = received.view(n, -1, *by_owner.shape[1:]).sum(dim=0)
        return mine.transpose(0, 1), None


class GatherSequence(nn.Module):
    """Concatenates every context-parallel rank's (B, S, heads, head_dim) keys or values along
    the sequence; the backward sums each rank's share of the gradient back to its owner."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _AllGatherSequence.apply(t, self.group)


def apply(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Every attention layer of `model` gathers its keys and values over `group`."""
    gather = GatherSequence(group)
    for block in model.layers:
        if hasattr(block, "attention"):
            block.attention.context = gather
