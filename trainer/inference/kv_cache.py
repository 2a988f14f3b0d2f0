"""A paged KV cache: fixed-size blocks in one pool per layer, a block table per sequence.

A sequence holds ceil(tokens / block_size) blocks, taken one at a time as it grows: nothing is
reserved for the longest it might become, so many more sequences fit than with a (batch,
max_len) cache. Token t of a sequence lives at row `t % block_size` of block
`table[t // block_size]`.

A layer's pool is one tensor (num_blocks, block_size, 2, kv_heads, head_dim): keys and values
of a position side by side, so a step writes them with one index and reads a sequence's context
with one index per block (`PagedKVCache.gather`: whole blocks, not position by position).
Attention then runs PyTorch's scaled_dot_product_attention on the gathered (batch, context)
tensor. vLLM's PagedAttention kernel reads the blocks in place instead; on CPU at this size the
copy of whole blocks is a small part of the step (bench/serve_results.md has the profile), and
it keeps the attention the same op the `generate` job runs.
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
    """Keys and values of every layer in pools of num_blocks blocks of block_size positions."""

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
        self.block_size, self.dtype = block_size, dtype
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, 2, n_kv_heads, head_dim)
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]

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

    def slots(self, table: list[int], start: int, stop: int) -> list[int]:
        """Pool slots (block * block_size + row) of positions start..stop-1 of the sequence with
        block table `table`."""
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, stop)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k and v (tokens, kv_heads, head_dim) at `slots`."""
        pool = self.kv[layer]
        pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, torch.stack((k, v), dim=1))

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (batch, blocks * block_size, kv_heads, head_dim) of the blocks in
        `tables` (batch, blocks); padding entries point at any block and are masked by the
        caller."""
        # index_select, not pool[tables]: it copies whole blocks as rows, where advanced
        # indexing goes element by element (7x slower here for 32 sequences of 5 blocks).
        pool = self.kv[layer]
        kv = pool.index_select(0, tables.flatten()).view(*tables.shape, *pool.shape[1:])
        kv = kv.flatten(1, 2)
        return kv[:, :, 0], kv[:, :, 1]
