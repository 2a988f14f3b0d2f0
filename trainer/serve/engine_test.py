"""The engine against trainer.generate on the same model: continuous batching, paged blocks,
preemption and aborts must not change what a greedy request generates."""

import random

import pytest
import torch

from trainer.generate import generate
from trainer.serve.engine import Engine, FinishReason, Request, SamplingParams, argmax_rows
from trainer.serve.kv_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from trainer.serve.testing import BOS, EOS, VOCAB, decode, serve_config, tiny_model

torch.set_num_threads(1)  # tiny ops: several threads only spin on a shared machine

MAX_LEN = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(EOS) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    out, _ = generate(
        model, prompt, max_tokens, temperature=0, stop_id=EOS, max_len=MAX_LEN, seed=0
    )
    return out


def run_all(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        engine.add(r)
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return tokens


def make_engine(model, **serve) -> Engine:
    return Engine(model, serve_config(**serve), decode=decode, eos_id=EOS, max_len=MAX_LEN)


def greedy(prompt, i, max_tokens=20) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def test_block_allocator_hands_out_each_block_once_and_reuses_freed_ones():
    a = BlockAllocator(3)
    got = [a.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and a.free == 0
    with pytest.raises(OutOfBlocks):
        a.allocate()
    a.release([got[1]])
    assert a.allocate() == got[1]


def test_cache_grows_a_table_block_by_block(model):
    cache = PagedKVCache(1, 2, 8, num_blocks=4, block_size=4, device="cpu", dtype=None)
    table: list[int] = []
    cache.grow(table, 5)
    assert len(table) == 2 and cache.allocator.used == 2
    with pytest.raises(OutOfBlocks):
        cache.grow(table, 17)
    assert len(table) == 2  # unchanged by the failed grow
    assert cache.slots(table, 3, 6) == [
        table[0] * 4 + 3,
        table[1] * 4 + 0,
        table[1] * 4 + 1,
    ]


def test_greedy_alone_equals_generate(model):
    prompt = prompts(1)[0]
    got = run_all(make_engine(model), [greedy(prompt, 0)])
    assert got["r0"] == reference(model, prompt, 20)


def test_greedy_inside_a_full_batch_equals_generate(model):
    ps = prompts(16, seed=1)
    engine = make_engine(model, max_batch_tokens=64, max_running=16)
    got = run_all(engine, [greedy(p, i) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(model, p, 20), f"request {i}"


def test_preempted_requests_are_recomputed_not_dropped(model):
    ps = prompts(8, seed=2)
    # 12 blocks of 4 tokens: not enough for 8 requests of up to 30 + 40 tokens at once.
    engine = make_engine(model, num_blocks=24, block_size=4, max_batch_tokens=32)
    got = run_all(engine, [greedy(p, i, max_tokens=40) for i, p in enumerate(ps)])
    assert engine.preemptions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(model, p, 40), f"request {i}"
    assert engine.cache.allocator.used == 0


def test_sampling_with_a_seed_equals_generate_with_that_seed(model):
    prompt = prompts(1, seed=3)[0]
    params = SamplingParams(max_tokens=15, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    engine = make_engine(model)
    others = [greedy(p, i + 1) for i, p in enumerate(prompts(5, seed=4))]
    got = run_all(engine, [Request("s", prompt, params), *others])
    want, _ = generate(
        model,
        prompt,
        15,
        temperature=0.9,
        top_k=20,
        top_p=0.9,
        seed=7,
        stop_id=EOS,
        max_len=MAX_LEN,
    )
    assert got["s"] == want


def test_abort_frees_the_blocks_of_a_running_request(model):
    engine = make_engine(model)
    engine.add(greedy(prompts(1)[0], 0, max_tokens=50))
    engine.step()
    assert engine.cache.allocator.used > 0
    assert engine.abort("r0")
    outs = engine.step()
    assert [(o.request_id, o.finish) for o in outs] == [("r0", FinishReason.ABORT)]
    assert engine.cache.allocator.used == 0 and not engine.has_work()


def test_stop_string_ends_the_text_before_it(model):
    prompt = prompts(1)[0]
    full = decode(reference(model, prompt, 20))
    stop = full[5:7]
    engine = make_engine(model)
    engine.add(Request("r", prompt, SamplingParams(max_tokens=20, temperature=0, stop=(stop,))))
    text, finish = "", None
    while engine.has_work():
        for o in engine.step():
            text, finish = text + o.text, o.finish
    assert text == full[: full.find(stop)] and finish is FinishReason.STOP


def test_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget(model):
    prompt = [i % EOS for i in range(70)]
    engine = make_engine(model, max_batch_tokens=16)
    got = run_all(engine, [greedy(prompt, 0, max_tokens=10)])
    assert got["r0"] == reference(model, prompt, 10)
    assert VOCAB > max(got["r0"])


def test_streamed_text_equals_decoding_the_whole_output_for_multibyte_characters(model):
    # A byte-level decoder: each token one byte of these characters (1 to 4 bytes of UTF-8), so
    # the stream meets half characters, which must wait for their end, and invalid sequences.
    utf8 = "aé€😀".encode()

    def decode_bytes(ids: list[int]) -> str:
        return bytes(utf8[i % len(utf8)] for i in ids if i < BOS).decode("utf-8", "replace")

    engine = Engine(model, serve_config(), decode=decode_bytes, eos_id=EOS, max_len=MAX_LEN)
    params = SamplingParams(max_tokens=40, temperature=1.5, seed=11)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(prompts(6, seed=5))]
    for r in requests:
        engine.add(r)
    texts = {r.id: "" for r in requests}
    while engine.has_work():
        for o in engine.step():
            assert "\ufffd" not in o.text[-1:] or o.finish is not None, "half a character sent"
            texts[o.request_id] += o.text
    for r in requests:
        assert texts[r.id] == decode_bytes(r.output), r.id
    assert any(len(t.encode()) > len(t) for t in texts.values())  # multi-byte characters came


def test_argmax_rows_is_argmax_first_of_ties_included():
    torch.manual_seed(0)
    logits = torch.randn(32, 4096)
    logits[3, 100] = logits[3, 4000] = 50.0  # a tie across blocks: the first wins
    logits[5, 70] = logits[5, 71] = 50.0  # inside one block
    logits[7, :] = 1.0  # all equal: index 0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[3] == 100 and argmax_rows(logits)[5] == 70
    for shape in ((1, 4096), (32, 100)):  # one row; a vocabulary not in whole blocks
        x = torch.randn(shape)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
