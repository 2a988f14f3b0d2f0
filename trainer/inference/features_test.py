"""#35's interaction test: every combination of the engine's serving features (prefix caching,
chunked prefill, speculative decoding off, by prompt lookup or by a draft model, preemption
forced by a small pool, structured output) gives the plain engine's answers (none of them, a
pool that holds everything; structured output: the plain engine under the same constraint),
greedy and seeded, with the same logprobs and top alternatives.

What is compared for a seeded sampled request with speculation on: not its tokens. The
rejection rule (speculative.py) consumes the request's generator differently from plain
sampling (the draft model's own draws, one uniform number per draft token), so the same seed
gives another answer from the same distribution; speculative_test.py tests that distribution
against plain sampling's. Here such an answer is checked token by token against the model
instead: each token's logprob is the full forward's log_softmax over the request's own context
(every feature fed the verifier the right keys and values). Greedy answers, with speculation
or without, and seeded answers without it, must equal the plain engine's. (A sampled
constrained request does not speculate: its answer must equal the plain engine's too.)

The model is inference/testing.py's tiny one, weights spread wide so that its next token is
decided by the model and depends on the context (checked below: a cache that handed a request
another's blocks would change its answer). The requests share a system prompt and come in two
waves, the second continuing the first's chats (a multi-turn conversation), so the prefix
cache has prefixes to find: blocks of the same wave, of the last wave, and a preempted
request's own.

Structured output constrains every request to a JSON schema over the toy vocabulary read as
JSON's characters (testing.py), with room for the whole answer: each finished answer must parse
and validate. The system prompt then starts with an example answer, so that prompt lookup
drafts the schema's fixed keys and the constrained drafts are verified (and some kept)."""

import itertools
import json
import random

import jsonschema
import pytest
import torch
import torch.nn.functional as F

from trainer.inference.engine import Engine, FinishReason, Request, SamplingParams
from trainer.inference.grammar import Constraint, Format
from trainer.inference.testing import (
    EOS,
    decode,
    json_decode,
    json_encode,
    json_vocabulary,
    perturbed,
    serve_config,
    tiny_model,
)

torch.set_num_threads(1)

MAX_LEN = 96
NEW = 12
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "s": {"type": "string", "maxLength": 4},
    },
    "required": ["n", "s"],
    "additionalProperties": False,
}
JSON_NEW = 24  # the longest answer is 20 tokens with its end of text


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


@pytest.fixture(scope="module")
def draft(model):
    return perturbed(model, 0.03, MAX_LEN)


def first_wave(structured: bool) -> list[list[int]]:
    rng = random.Random(3)
    system = [rng.randrange(EOS) for _ in range(21)]
    if structured:
        system = json_encode('{"n":7,"s":"ab"}') + system[:5]
    return [system + [rng.randrange(EOS) for _ in range(rng.randrange(1, 12))] for _ in range(8)]


def params(i: int, structured: bool) -> SamplingParams:
    n = JSON_NEW if structured else NEW
    c = Constraint(Format.JSON_SCHEMA, json.dumps(SCHEMA)) if structured else None
    if i % 2:
        return SamplingParams(n, 0, logprobs=True, top_logprobs=2, constraint=c)
    return SamplingParams(n, 0.9, top_k=20, seed=100 + i, logprobs=True, constraint=c)


Answer = tuple[list[int], list[float], list, list[int]]  # ids, logprobs, top logprobs, prompt


def run(model, structured: bool, draft=None, **serve) -> tuple[dict[str, Answer], Engine]:
    """Two waves on one engine: the answers of every request by id."""
    engine = Engine(
        model,
        serve_config(**serve),
        decode=json_decode if structured else decode,
        eos_id=EOS,
        max_len=MAX_LEN,
        grammar=json_vocabulary() if structured else None,
        draft=draft,
    )
    rng = random.Random(4)
    prompts, got = first_wave(structured), {}
    for wave in range(2):
        requests = [
            Request(f"w{wave}r{i}", p, params(i, structured)) for i, p in enumerate(prompts)
        ]
        for r in requests:
            engine.add(r)
        while engine.has_work():
            engine.step()
        got.update({r.id: (r.output, r.logprobs, r.top_logprobs, r.prompt) for r in requests})
        if structured:  # every answer is whole (JSON_NEW has room), and valid
            assert all(r.finish is FinishReason.STOP for r in requests)
            for r in requests:
                jsonschema.validate(json.loads(json_decode(r.output)), SCHEMA)
        prompts = [r.prompt + r.output + [rng.randrange(EOS)] for r in requests]
    return got, engine


@pytest.fixture(scope="module")
def plain(model) -> dict[bool, dict[str, Answer]]:
    """The plain engine's answers, unconstrained (False) and structured (True)."""
    answers = {}
    for structured in (False, True):
        got, engine = run(
            model,
            structured,
            prefix_caching=False,
            chunked_prefill=False,
            num_blocks=256,
            block_size=16,
        )
        assert engine.scheduler.preemptions == 0 and engine.scheduler.cached_tokens == 0
        answers[structured] = got
    return answers


@pytest.mark.parametrize("structured", [False, True])
def test_the_answers_depend_on_the_context(model, plain, structured):
    greedy = [plain[structured][f"w0r{i}"][0] for i in range(1, 8, 2)]
    assert len({tuple(g) for g in greedy}) == len(greedy)  # same system prompt, other questions


SPECULATION = ["off", "prompt_lookup", "draft_model"]
COMBINATIONS = list(
    itertools.product([False, True], [False, True], SPECULATION, [False, True], [False, True])
)


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
    "prefix, chunked, speculation, small_pool, structured",
    COMBINATIONS,
    ids=[
        f"prefix={p}-chunked={c}-spec={d}-small_pool={s}-structured={j}"
        for p, c, d, s, j in COMBINATIONS
    ],
)
def test_every_combination_equals_the_plain_engine(
    model, draft, plain, prefix, chunked, speculation, small_pool, structured
):
    # A small pool holds one request at its longest: 72 positions, 84 for a structured one.
    small = 21 if structured else 18
    got, engine = run(
        model,
        structured,
        draft if speculation == "draft_model" else None,
        prefix_caching=prefix,
        chunked_prefill=chunked,
        speculative_tokens=0 if speculation == "off" else 4,
        max_batch_tokens=16,
        block_size=4,
        num_blocks=small if small_pool else 256,
    )
    for rid, (ids, logprobs, top, _) in plain[structured].items():
        sampled = params(int(rid[-1]), structured).temperature > 0
        if speculation != "off" and got[rid][0] != ids and sampled and not structured:
            assert_scored_by_the_model(model, got[rid])  # module docstring: another answer
            continue
        assert got[rid][0] == ids, rid
        torch.testing.assert_close(got[rid][1], logprobs, rtol=0, atol=1e-4)
        assert [[i for i, _ in t] for t in got[rid][2]] == [[i for i, _ in t] for t in top]
        torch.testing.assert_close(got[rid][2], top, rtol=0, atol=1e-4)
    assert (engine.scheduler.preemptions > 0) == small_pool
    assert (engine.scheduler.cached_tokens > 0) == prefix
    assert (engine.accepted > 0) == (speculation != "off")  # drafts were kept, and so checked
    assert engine.cache.allocator.used == 0
    if engine.drafter is not None:
        assert engine.drafter.cache.allocator.used == 0 and not engine.drafter.states
