"""The engine's scheduler (engine.py): which requests run in the next step, and how many
tokens each, under the step's token budget (serve.max_batch_tokens) and the free KV blocks.
It owns the queues (waiting, running) and the blocks' growth; the engine runs what it
schedules and samples.

Each step spends at most `max_batch_tokens`: every decoding request first (one token each),
then prefill, in chunks, of requests still reading their prompt, then new admissions: a long
prompt arriving never stalls the running streams (serve.chunked_prefill; off, a prompt is
prefilled in one piece, past the budget if it must, and the streams wait for that step). A
request takes KV-cache blocks only as it grows.

When a decoding request needs a block and none is free, the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt + what it generated so far, as a prefill) when blocks free up. Nothing is dropped; its
generated tokens and its sampler's state are kept. A request that could never finish is
refused at `add` (admission.py): the context and the pool must hold it at its longest, so
every admitted request can run alone to its end, and none holds the queue back forever.

With prefix caching, a request about to be admitted first takes the cached blocks of its
longest cached prefix (`reuse_prefix`), and every full block a step fills is registered under
its name (`name_blocks`). With speculative decoding, a decoding request is given its draft's
positions too (`draft`): a prompt-lookup draft now, a draft model's once the step is
scheduled (`proposing`, run by the engine).
"""

from collections import deque
from typing import TYPE_CHECKING

from protos import trainer_config_pb2
from trainer.inference.kv_cache import PagedKVCache, block_hashes
from trainer.inference.speculative import DraftModel, ngram_draft

if TYPE_CHECKING:  # engine.py imports this module
    from trainer.inference.engine import Request


class Scheduler:
    def __init__(
        self,
        cfg: trainer_config_pb2.ServeConfig,
        cache: PagedKVCache,
        max_len: int,
        drafter: DraftModel | None,
    ):
        self.cfg, self.cache, self.max_len, self.drafter = cfg, cache, max_len, drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.prompt_tokens = 0  # admitted since the start, and of those read from the cache
        self.cached_tokens = 0
        self.proposing: list[tuple[Request, int]] = []  # this step's draft-model requests

    def schedule(self) -> list[tuple["Request", int]]:
        """(request, new tokens) for this step, under the token budget; preempts when a
        decoding request finds no free block."""
        budget = self.cfg.max_batch_tokens
        scheduled: list[tuple[Request, int]] = []
        decoding = [r for r in self.running if r.length - r.computed == 1]
        preempted = False
        for r in decoding:
            if budget == 0:
                break
            if preempted and r not in self.running:
                continue  # preempted below, to make room for an older request
            while not self.fits(r, 1):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is r:
                    break
            if not preempted or r in self.running:
                n = 1 + self.draft(r, budget - 1)
                scheduled.append((r, n))
                budget -= n
        for r in self.running:
            left = r.length - r.computed
            if left > 1 and budget > 0:
                n = self.chunk(r, left, budget)
                if n:
                    scheduled.append((r, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            r = self.waiting[0]
            self.reuse_prefix(r)
            n = self.chunk(r, r.length - r.computed, budget)
            if not n:
                self.release(r)  # the cached blocks too: nothing is held while waiting
                break  # no free block: it waits for one (admission never preempts)
            self.waiting.popleft()
            self.running.append(r)
            scheduled.append((r, n))
            budget -= n
            if r.cached_tokens is None:  # its first admission
                r.cached_tokens = r.computed
                self.prompt_tokens += len(r.prompt)
                self.cached_tokens += r.computed
        if not scheduled and self.running:  # every running request waits for a block
            self.preempt(self.running[-1])
            return self.schedule()
        return scheduled

    def draft(self, r: "Request", room: int) -> int:
        """How many speculative tokens a decoding request runs this step (speculative.py),
        their blocks taken; none when off, out of budget or blocks, or near its end. A prompt
        lookup draft is r.draft now; a draft model's is proposed once the step is scheduled."""
        p = r.params
        k = min(self.cfg.speculative_tokens, room, p.max_tokens - len(r.output) - 1)
        k = min(k, self.max_len - r.length - 1)
        if k <= 0 or (r.matcher is not None and p.temperature > 0):
            # a sampled constrained request does not speculate: the rejection rule would need
            # the grammar's mask on both distributions at each drafted position
            return 0
        if self.drafter is not None:
            if not (self.fits(r, 1 + k) and self.drafter.reserve(r, k)):
                return 0
            self.proposing.append((r, k))
            return k
        draft = ngram_draft(r.tokens, k)
        if r.matcher is not None:  # a token the grammar forbids could never be kept
            draft = r.matcher.valid_prefix(draft)
        if draft and self.fits(r, 1 + len(draft)):
            r.draft = draft
        return len(r.draft)

    def fits(self, r: "Request", n: int) -> bool:
        """Grows r's block table to hold n more positions, if the blocks are there."""
        if r.computed + n <= len(r.table) * self.cache.block_size:
            return True  # its last block has room
        if self.cache.blocks_for(r.computed + n) - len(r.table) > self.cache.allocator.free:
            return False
        self.cache.grow(r.table, r.computed + n)
        return True

    def chunk(self, r: "Request", left: int, budget: int) -> int:
        """How many of r's `left` prompt tokens to prefill now, their blocks taken (0: none):
        as many as the budget and the free blocks allow, or without chunked prefill all of
        them or none."""
        free_positions = (len(r.table) + self.cache.allocator.free) * self.cache.block_size
        n = min(left, budget) if self.cfg.chunked_prefill else left
        n = min(n, free_positions - r.computed)
        if n <= 0 or (n < left and not self.cfg.chunked_prefill):
            return 0
        self.cache.grow(r.table, r.computed + n)
        return n

    def reuse_prefix(self, r: "Request") -> None:
        """A request about to be admitted takes the cached blocks of its longest cached prefix
        (full blocks, leaving at least its last token to compute: its logits are needed)."""
        if not self.cfg.prefix_caching or r.table:
            return
        full = (r.length - 1) // self.cache.block_size
        names = block_hashes(r.tokens, self.cache.block_size, full, r.block_names, r.root)
        r.table = self.cache.allocator.lookup(names[:full])
        r.named = len(r.table)
        r.computed = r.named * self.cache.block_size

    def name_blocks(self, r: "Request") -> None:
        """Registers the blocks r has filled since the last step under their names."""
        full = r.computed // self.cache.block_size
        if not self.cfg.prefix_caching or full <= r.named:
            return
        block_hashes(r.tokens, self.cache.block_size, full, r.block_names, r.root)
        for i in range(r.named, full):
            self.cache.allocator.register(r.table[i], r.block_names[i])
        r.named = full

    def preempt(self, r: "Request") -> None:
        self.running.remove(r)
        self.release(r)
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    def release(self, r: "Request") -> None:
        self.cache.release(r.table)
        if self.drafter is not None:
            self.drafter.release(r)
        r.computed = r.named = 0
