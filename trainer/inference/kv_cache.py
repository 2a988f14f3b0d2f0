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
copy of whole blocks is a small part of the step (trainer/bench/serve_results.md has the
profile), and it keeps the attention the same op the `generate` job runs.

Prefix caching (serve.prefix_caching, vLLM's automatic prefix caching, SGLang's RadixAttention
in blocks): a full block is named by a hash chained over every token up to its end (and a VLM
request's image), so two sequences that start with the same tokens name their first blocks
alike, whatever follows. The pool keeps a reference count per block: a block named by a hash
is shared by every sequence whose prefix it holds, read-only (a sequence writes only past its
last full block, so a shared block is never written). A block whose count falls to 0 is free
but keeps its keys, values and name; the free list is least-recently-freed first, and a free
block is only evicted (its name dropped) when it is handed out again. A sequence's blocks are
freed last block first, so its shared prefix outlives its private tail.
"""

import hashlib
from array import array
from collections import OrderedDict

import torch


class OutOfBlocks(Exception):
    """The pool has no free block left (the scheduler preempts a request and tries again)."""


def block_hashes(
    tokens: list[int], block_size: int, blocks: int, hashes: list[bytes], root: bytes = b""
) -> list[bytes]:
    """Extends `hashes` (in place, and returns it) to the names of the first `blocks` full
    blocks of `tokens`: block i's is sha256(block i-1's name, its tokens), the first's chained
    from `root` (a VLM request's image digest). A collision would hand one sequence another's
    keys: a 256-bit digest, not Python's 64-bit hash()."""
    for i in range(len(hashes), blocks):
        h = hashlib.sha256(hashes[i - 1] if i else root)
        h.update(array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes())
        hashes.append(h.digest())
    return hashes


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 with reference counts; a freed block goes to the
    end of the free list and the front is handed out first (least recently freed). With
    `caching`, full blocks are registered under their hash and found again (module docstring)."""

    def __init__(self, num_blocks: int, caching: bool = False):
        self.num_blocks, self.caching = num_blocks, caching
        self.refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._name: dict[int, bytes] = {}  # block -> its hash, while it holds a named block
        self._block: dict[bytes, int] = {}  # hash -> block
        self.shared = 0  # blocks with more than one reference

    @property
    def free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted when needed)."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def cached(self) -> int:
        """Blocks that hold a named full block (held or free)."""
        return len(self._name)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        block, _ = self._free.popitem(last=False)
        name = self._name.pop(block, None)
        if name is not None:  # evicted: its contents will be overwritten
            del self._block[name]
        self.refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # the tail first: evicted before the shared prefix
            self.refs[block] -= 1
            if self.refs[block] == 1:
                self.shared -= 1
            elif self.refs[block] == 0:
                self._free[block] = None

    def lookup(self, names: list[bytes]) -> list[int]:
        """The blocks of the longest prefix of `names` in the cache, each one more reference."""
        found = []
        for name in names:
            block = self._block.get(name)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._free[block]
            elif self.refs[block] == 1:
                self.shared += 1
            self.refs[block] += 1
            found.append(block)
        return found

    def register(self, block: int, name: bytes) -> None:
        """Names a full block (a no-op without caching, or when another block has the name)."""
        if self.caching and name not in self._block and block not in self._name:
            self._block[name], self._name[block] = block, name


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
        caching: bool = False,
    ):
        self.block_size, self.dtype = block_size, dtype
        self.allocator = BlockAllocator(num_blocks, caching)
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
