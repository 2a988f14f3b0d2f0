"""The engine against a full forward per token (no cache) on the same model: continuous
batching, paged blocks, preemption and aborts must not change what a greedy request
generates."""

import random

import pytest
import torch

from trainer.generate import generate
from trainer.inference.admission import RequestTooLarge
from trainer.inference.engine import Engine, FinishReason, Request, SamplingParams
from trainer.inference.kv_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from trainer.inference.speculative import ngram_draft
from trainer.inference.testing import (
    BOS,
    EOS,
    VOCAB,
    decode,
    greedy_full_forward,
    serve_config,
    tiny_model,
)

torch.set_num_threads(1)  # tiny ops: several threads only spin on a shared machine

MAX_LEN = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(EOS) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    return greedy_full_forward(model, prompt, max_tokens, stop=EOS)


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


def test_greedy_alone_equals_a_full_forward(model):
    prompt = prompts(1)[0]
    got = run_all(make_engine(model), [greedy(prompt, 0)])
    assert got["r0"] == reference(model, prompt, 20)


def test_greedy_inside_a_full_batch_equals_a_full_forward(model):
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
    assert engine.scheduler.preemptions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(model, p, 40), f"request {i}"
    assert engine.cache.allocator.used == 0


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(model):
    prompt = prompts(1, seed=3)[0]
    params = SamplingParams(max_tokens=15, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    engine = make_engine(model)
    others = [greedy(p, i + 1) for i, p in enumerate(prompts(3, seed=4))]
    for i, p in enumerate(prompts(3, seed=8)):  # sampled beside it, with other settings
        knobs = SamplingParams(max_tokens=10 + i, temperature=1.2, top_p=0.5 + i / 10, seed=i)
        others.append(Request(f"o{i}", p, knobs))
    got = run_all(engine, [Request("s", prompt, params), *others])
    want, _ = generate(  # alone in an engine of its own
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


def test_a_stop_token_ends_the_ids_with_it_and_never_shows_in_the_text(model):
    prompt = prompts(1, seed=5)[0]
    full = reference(model, prompt, 20)
    stop_token = full[4]
    stop = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_token,))
    engine = make_engine(model)
    request = Request("r", prompt, stop)
    got = run_all(engine, [request])
    end = full.index(stop_token) + 1
    assert got["r"] == full[:end] and request.finish is FinishReason.STOP
    assert request.text == decode(full[: end - 1])  # the stop token's letter is not there


def test_logprobs_are_the_full_forwards_log_softmax_of_each_sampled_token(model):
    """Each sampled token's log-probability, and its top 3 alternatives, are the trainer's
    model forward's log_softmax at that position (temperature 1), in the request and in its
    outputs, whatever temperature and filters drew it."""
    prompt = prompts(1, seed=6)[0]
    params = SamplingParams(
        max_tokens=12, temperature=0.7, top_k=10, seed=1, logprobs=True, top_logprobs=3
    )
    engine = make_engine(model)
    request = Request("r", prompt, params)
    for r in [request, *(greedy(p, i + 1) for i, p in enumerate(prompts(3, seed=7)))]:
        engine.add(r)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    ids = torch.tensor([prompt + request.output])
    with torch.no_grad():
        logp = model(ids, torch.arange(ids.shape[1])[None])[0].log_softmax(-1)
    logp = logp[len(prompt) - 1 : -1]
    want = logp.gather(1, ids[0, len(prompt) :, None])[:, 0]
    assert len(request.logprobs) == len(request.output)
    torch.testing.assert_close(torch.tensor(request.logprobs), want, rtol=0, atol=1e-5)
    top_values, top_ids = logp.topk(3, dim=-1)
    assert [[i for i, _ in t] for t in request.top_logprobs] == top_ids.tolist()
    got_values = torch.tensor([[v for _, v in t] for t in request.top_logprobs])
    torch.testing.assert_close(got_values, top_values, rtol=0, atol=1e-5)
    assert [o.logprobs for o in outputs] == list(
        zip(request.logprobs, request.top_logprobs, strict=True)
    )


def test_a_request_longer_than_the_pool_is_refused_naming_the_field(model):
    """#36: 32 pool positions; a request of 10 + 30 tokens could never finish."""
    engine = make_engine(model, num_blocks=8, block_size=4)
    with pytest.raises(RequestTooLarge, match="max_tokens: max_tokens 30 plus") as e:
        engine.add(greedy(list(range(10)), 0, max_tokens=30))
    assert e.value.field == "max_tokens" and not engine.has_work()
    with pytest.raises(RequestTooLarge) as e:
        engine.add(greedy(list(range(40)), 1, max_tokens=1))
    assert e.value.field == "prompt"
    ps = prompts(6, seed=9)  # each fits alone: all finish, preempting one another
    got = run_all(engine, [greedy(p[:12], i, max_tokens=20) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(model, p[:12], 20), f"request {i}"


def test_prompt_lookup_drafts_the_tokens_after_the_last_ngrams_earlier_occurrence():
    assert ngram_draft([1, 2, 3, 9, 8, 7, 1, 2, 3], 2) == [9, 8]  # the 3-gram 1 2 3
    assert ngram_draft([5, 1, 2, 6, 1, 2, 7, 2], 3) == [7, 2]  # 1-gram 2: its latest
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([4], 4) == []


def test_speculative_greedy_equals_plain_greedy_and_counts_what_it_kept(model):
    """A prompt that repeats itself, so drafts are proposed; every greedy answer is a full
    forward's, sampled requests draft nothing."""
    ps = [p * 3 for p in prompts(6, seed=11)]
    engine = make_engine(model, speculative_tokens=4, max_batch_tokens=64)
    sampled = Request("s", ps[0], SamplingParams(max_tokens=20, temperature=0.9, seed=1))
    got = run_all(engine, [greedy(p[:40], i) for i, p in enumerate(ps)] + [sampled])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(model, p[:40], 20), f"request {i}"
    assert 0 < engine.accepted <= engine.drafted
