"""A paged KV cache: fixed-size blocks in one pool per layer, a block table per sequence.

A sequence holds ceil(tokens / block_size) blocks, taken one at a time as it grows: nothing is
reserved for the longest it might become, so many more sequences fit than with a (batch,
max_len) cache. Token t of a sequence lives in slot `table[t // block_size] * block_size +
t % block_size` of the pool.

Attention over the blocks (`PagedKVCache.gather`) copies a step's context into a contiguous
(batch, context, heads, head_dim) tensor with one index per layer, then runs PyTorch's
scaled_dot_product_attention on it. vLLM's PagedAttention kernel reads the blocks in place
instead; on CPU at this size the copy is cheap next to the matmuls, and it keeps the attention
the same op the `generate` job runs.
"""

from collections import deque

import torch


class OutOfBlocks(Exception):
    """The pool has no free block left (the scheduler preempts a request and tries again)."""


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1; a freed block is reused first-in first-out."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        return self._free.popleft()

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class PagedKVCache:
    """Keys and values of every layer in pools of (num_blocks * block_size) slots."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device,
        dtype: torch.dtype,
    ):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions."""
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extends `table` (in place) to hold `tokens` positions; OutOfBlocks leaves it as it
        was."""
        need = self.blocks_for(tokens) - len(table)
        if need > self.allocator.free:
            raise OutOfBlocks(f"{need} blocks needed, {self.allocator.free} free")
        table.extend(self.allocator.allocate() for _ in range(need))

    def release(self, table: list[int]) -> None:
        self.allocator.release(table)
        table.clear()

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Pool slots of positions start..stop-1 of the sequence with block table `table`."""
        positions = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k and v (tokens, kv_heads, head_dim) at `slots`."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def gather(self, layer: int, context_slots: torch.Tensor):
        """Keys and values (batch, context, kv_heads, head_dim) at `context_slots` (batch,
        context); padded entries point at any slot and are masked by the caller."""
        return self.k[layer][context_slots], self.v[layer][context_slots]
