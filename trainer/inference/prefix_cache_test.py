"""Prefix caching (#35): the pool's LRU eviction and reference counts, and the engine's block
and cached-token figures checked after every step against a recomputation from its own block
tables and from the token prefixes its requests computed before."""

import random

import pytest
import torch

from trainer.inference.engine import Engine, Request, SamplingParams
from trainer.inference.kv_cache import BlockAllocator, block_hashes
from trainer.inference.testing import EOS, decode, serve_config, tiny_model

torch.set_num_threads(1)

MAX_LEN = 96
BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


def test_names_chain_over_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, [])
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2, [])
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, 2, [])
    assert a == b and len(a) == 2
    assert c[1] != a[1]  # the same second block after another first one: another name
    assert block_hashes([1, 2, 3, 4], 4, 1, [], root=b"image")[0] != a[0]


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockAllocator(3, caching=True)
    names = [bytes([i]) * 32 for i in range(3)]
    blocks = [pool.allocate() for _ in range(3)]
    for b, n in zip(blocks, names, strict=True):
        pool.register(b, n)
    pool.release([blocks[2]])
    pool.release([blocks[0]])
    pool.release([blocks[1]])
    assert pool.free == 3 and pool.cached == 3  # free, and still found
    assert pool.lookup(names[:1]) == [blocks[0]] and pool.free == 2
    new = pool.allocate()  # the least recently freed of the free ones: block 2, evicted
    assert new == blocks[2] and pool.lookup([names[2]]) == []
    assert pool.lookup(names[:2]) == [blocks[0], blocks[1]]
    assert pool.refs[blocks[0]] == 2 and pool.shared == 1
    pool.release([blocks[0], blocks[1]])
    assert pool.shared == 0 and pool.refs[blocks[0]] == 1


def check_blocks_against_tables(engine: Engine) -> None:
    """The pool's figures equal what the running requests' block tables say."""
    pool = engine.cache.allocator
    holders: dict[int, int] = {}
    for r in engine.scheduler.running:
        for b in r.table:
            holders[b] = holders.get(b, 0) + 1
    assert pool.used == len(holders) and pool.free == pool.num_blocks - len(holders)
    assert pool.shared == sum(1 for n in holders.values() if n > 1)
    assert all(pool.refs[b] == holders.get(b, 0) for b in range(pool.num_blocks))


def test_block_and_cached_token_figures_equal_a_recomputation(model):
    """A shared system prompt and multi-turn chats (each turn's prompt is the last turn's
    prompt and answer, and more): each request's cached tokens are the longest full-block
    prefix of its prompt that earlier steps computed (the pool is large enough that nothing is
    evicted), and the totals the metrics report add up."""
    rng = random.Random(0)
    system = [rng.randrange(EOS) for _ in range(13)]
    engine = Engine(
        model,
        serve_config(num_blocks=512, block_size=BS, max_batch_tokens=24),
        decode=decode,
        eos_id=EOS,
        max_len=MAX_LEN,
    )
    computed: set[tuple[int, ...]] = set()  # the full-block prefixes computed so far
    chats = [system + [rng.randrange(EOS) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    seen: list[Request] = []
    for turn in range(3):
        batch = []
        for i, prompt in enumerate(chats):
            params = SamplingParams(max_tokens=6, temperature=0 if i % 2 else 0.8, seed=i)
            batch.append(Request(f"c{i}t{turn}", list(prompt), params))
            engine.add(batch[-1])
        while engine.has_work():
            before = set(computed)
            waiting = [r for r in batch if r.cached_tokens is None]
            engine.step()
            check_blocks_against_tables(engine)
            for r in waiting:
                if r.cached_tokens is not None:  # admitted in this step
                    k = (len(r.prompt) - 1) // BS
                    while k and tuple(r.prompt[: k * BS]) not in before:
                        k -= 1
                    assert r.cached_tokens == k * BS, r.id
            for r in batch:  # a finished request computed all but its last token
                done = r.computed if r.finish is None else r.length - 1
                computed.update(tuple(r.tokens[: k * BS]) for k in range(1, done // BS + 1))
        seen += batch
        chats = [r.prompt + r.output + [rng.randrange(EOS) for _ in range(3)] for r in batch]
    pool = engine.cache.allocator
    assert pool.cached == len(computed)  # every distinct full block named once, none evicted
    assert engine.scheduler.cached_tokens == sum(r.cached_tokens or 0 for r in seen) > 0
    assert engine.scheduler.prompt_tokens == sum(len(r.prompt) for r in seen)
    assert pool.used == 0 and pool.free == pool.num_blocks
