"""#35's interaction test: every combination of the engine's serving features (prefix caching,
chunked prefill, speculative decoding off, by prompt lookup or by a draft model, preemption
forced by a small pool) gives the plain engine's answers (none of them, a pool that holds
everything), greedy and seeded, with the same logprobs and top alternatives.

What is compared for a seeded sampled request with speculation on: not its tokens. The
rejection rule (speculative.py) consumes the request's generator differently from plain
sampling (the draft model's own draws, one uniform number per draft token), so the same seed
gives another answer from the same distribution; speculative_test.py tests that distribution
against plain sampling's. Here such an answer is checked token by token against the model
instead: each token's logprob is the full forward's log_softmax over the request's own context
(every feature fed the verifier the right keys and values). Greedy answers, with speculation
or without, and seeded answers without it, must equal the plain engine's.

The model is inference/testing.py's tiny one, weights spread wide so that its next token is
decided by the model and depends on the context (checked below: a cache that handed a request
another's blocks would change its answer). The requests share a system prompt and come in two
waves, the second continuing the first's chats (a multi-turn conversation), so the prefix
cache has prefixes to find: blocks of the same wave, of the last wave, and a preempted
request's own."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from trainer.inference.engine import Engine, Request, SamplingParams
from trainer.inference.testing import EOS, decode, serve_config, tiny_model

torch.set_num_threads(1)

MAX_LEN = 96
NEW = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


@pytest.fixture(scope="module")
def draft(model):
    """The target perturbed: a draft that agrees with it often, not always."""
    draft = tiny_model(MAX_LEN)
    with torch.no_grad():
        for d, t in zip(draft.parameters(), model.parameters(), strict=True):
            d.copy_(t + 0.03 * torch.randn_like(t))
    return draft


def first_wave() -> list[list[int]]:
    rng = random.Random(3)
    system = [rng.randrange(EOS) for _ in range(21)]
    return [system + [rng.randrange(EOS) for _ in range(rng.randrange(1, 12))] for _ in range(8)]


def params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=2)
    return SamplingParams(max_tokens=NEW, temperature=0.9, top_k=20, seed=100 + i, logprobs=True)


Answer = tuple[list[int], list[float], list, list[int]]  # ids, logprobs, top logprobs, prompt


def run(model, draft=None, **serve) -> tuple[dict[str, Answer], Engine]:
    """Two waves on one engine: the answers of every request by id."""
    cfg = serve_config(**serve)
    engine = Engine(model, cfg, decode=decode, eos_id=EOS, max_len=MAX_LEN, draft=draft)
    rng = random.Random(4)
    prompts, got = first_wave(), {}
    for wave in range(2):
        requests = [Request(f"w{wave}r{i}", p, params(i)) for i, p in enumerate(prompts)]
        for r in requests:
            engine.add(r)
        while engine.has_work():
            engine.step()
        got.update({r.id: (r.output, r.logprobs, r.top_logprobs, r.prompt) for r in requests})
        prompts = [r.prompt + r.output + [rng.randrange(EOS)] for r in requests]
    return got, engine


@pytest.fixture(scope="module")
def plain(model):
    got, engine = run(
        model, prefix_caching=False, chunked_prefill=False, num_blocks=256, block_size=16
    )
    assert engine.preemptions == 0 and engine.cached_tokens == 0
    return got


def test_the_answers_depend_on_the_context(model, plain):
    greedy = [plain[f"w0r{i}"][0] for i in range(1, 8, 2)]
    assert len({tuple(g) for g in greedy}) == len(greedy)  # same system prompt, other questions


SPECULATION = ["off", "prompt_lookup", "draft_model"]
COMBINATIONS = list(itertools.product([False, True], [False, True], SPECULATION, [False, True]))


@torch.no_grad()
def assert_scored_by_the_model(model, answer: Answer) -> None:
    """Each token's logprob and top-2 alternatives are the full forward's over its context."""
    ids, logprobs, top, prompt = answer
    tokens = torch.tensor([prompt + ids])
    logp = F.log_softmax(model(tokens, torch.arange(tokens.shape[1])[None])[0].float(), -1)
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
    want = rows.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-4)
    assert top == [()] * len(ids)  # sampled requests ask for no alternatives (params)


@pytest.mark.parametrize(
    "prefix, chunked, speculation, small_pool",
    COMBINATIONS,
    ids=[f"prefix={p}-chunked={c}-spec={d}-small_pool={s}" for p, c, d, s in COMBINATIONS],
)
def test_every_combination_equals_the_plain_engine(
    model, draft, plain, prefix, chunked, speculation, small_pool
):
    got, engine = run(
        model,
        draft if speculation == "draft_model" else None,
        prefix_caching=prefix,
        chunked_prefill=chunked,
        speculative_tokens=0 if speculation == "off" else 4,
        max_batch_tokens=16,
        block_size=4,
        num_blocks=18 if small_pool else 256,  # 72 positions: one request at its longest
    )
    for rid, (ids, logprobs, top, _) in plain.items():
        if speculation != "off" and got[rid][0] != ids and params(int(rid[-1])).temperature:
            assert_scored_by_the_model(model, got[rid])  # module docstring: another answer
            continue
        assert got[rid][0] == ids, rid
        torch.testing.assert_close(got[rid][1], logprobs, rtol=0, atol=1e-4)
        assert [[i for i, _ in t] for t in got[rid][2]] == [[i for i, _ in t] for t in top]
        torch.testing.assert_close(got[rid][2], top, rtol=0, atol=1e-4)
    assert (engine.preemptions > 0) == small_pool
    assert (engine.cached_tokens > 0) == prefix
    assert (engine.accepted > 0) == (speculation != "off")  # drafts were kept, and so checked
    assert engine.cache.allocator.used == 0
    if engine.drafter is not None:
        assert engine.drafter.cache.allocator.used == 0 and not engine.drafter.states
