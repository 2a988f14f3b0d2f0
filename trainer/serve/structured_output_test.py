"""Structured output over HTTP (#35): `response_format` json_schema, json_object and regex on
both endpoints of a live server, whose tokenizer is a byte-level BPE trained here (Kitchen's
`bpe` kind, its tokenizer.json read by llguidance) and whose model has that vocabulary. Every
answer parses and validates; a schema or pattern no answer can satisfy is a 400 naming the
field; the grammar metrics count what the engine masked; cl100k's vocabulary works too."""

import json
import re

import jsonschema
import openai
import pytest
import torch

from trainer.data.tokenizer import cl100k, train_bpe
from trainer.inference.grammar import Constraint, Format, Grammars
from trainer.inference.testing import serve_config, tiny_model
from trainer.serve.api import ServedModel
from trainer.serve.server import Server, grammar_vocabulary

torch.set_num_threads(1)

MAX_LEN = 128
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "cook": {"type": "boolean"},
        "dishes": {"type": "array", "items": {"enum": ["soup", "bread", "pie"]}, "maxItems": 3},
    },
    "required": ["name", "age", "cook", "dishes"],
    "additionalProperties": False,
}
CORPUS = [
    '{"name": "Ada", "age": 36, "cook": true, "dishes": ["soup", "pie"]}',
    "the kitchen serves soup and bread to every guest at noon",
    '{"id": 7, "tags": ["x", "y"], "ok": false, "note": null}',
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(CORPUS * 10, 400)


@pytest.fixture(scope="module")
def server(tokenizer):
    model = tiny_model(MAX_LEN, vocab=tokenizer.vocab_size)
    served = ServedModel(
        "tiny", tokenizer.encode, tokenizer.bos_id, MAX_LEN, 0,
        grammar=grammar_vocabulary(tokenizer),
    )  # fmt: skip
    s = Server(
        model,
        serve_config(max_waiting=64),
        served,
        decode=tokenizer.decode,
        eos_id=tokenizer.eos_id,
        vocab=tokenizer.vocab_size,
    ).start()
    yield s
    assert s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.endpoint + "/v1", api_key="unused", max_retries=0)


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def chat(client, content: str, response_format: dict, **kw):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=80, response_format=response_format, **kw
    )


def test_every_json_schema_answer_parses_and_validates(client):
    answers = set()
    for seed in range(6):  # greedy, then seeded samples: the model decides the values
        kw = {"temperature": 0} if seed == 0 else {"temperature": 1.0, "seed": seed}
        got = chat(client, f"who cooks? {seed}", person_format(), **kw)
        choice = got.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        answers.add(choice.message.content)
    assert len(answers) > 1  # the values are the model's, not the grammar's


def test_completions_and_streaming_take_response_format(client):
    whole = client.completions.create(
        model="tiny", prompt="a guest", max_tokens=80, temperature=0,
        extra_body={"response_format": person_format()},
    )  # fmt: skip
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].text), PERSON)
    chunks = client.completions.create(
        model="tiny", prompt="a guest", max_tokens=80, temperature=0, stream=True,
        extra_body={"response_format": person_format()},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_json_object_and_regex(client):
    got = chat(client, "anything", {"type": "json_object"}, temperature=0)
    if got.choices[0].finish_reason == "stop":  # an object may nest past max_tokens
        assert isinstance(json.loads(got.choices[0].message.content), dict)
    pattern = r"(soup|bread|pie)( and (soup|bread|pie)){0,2}\."
    for seed in range(4):
        got = chat(client, "lunch?", {"type": "regex", "regex": pattern}, seed=seed)
        assert got.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, got.choices[0].message.content)


@pytest.mark.parametrize(
    "response_format, param, says",
    [
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                },
            },
            "response_format.json_schema.schema",
            "Unsatisfiable",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "numbr"}}},
            "response_format.json_schema.schema",
            "numbr",
        ),
        ({"type": "regex", "regex": "(ab"}, "response_format.regex", "unclosed group"),
        ({"type": "json_schema"}, "response_format", "json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "n"}},
            "response_format.json_schema.schema",
            "Field required",
        ),
        ({"type": "yaml"}, "response_format.type", "json_schema"),
    ],
)
def test_a_format_no_answer_can_satisfy_is_a_400_naming_the_field(
    client, response_format, param, says
):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "x", response_format)
    error = err.value.body
    assert error["param"] == param and says in error["message"], error


def test_grammar_metrics_count_the_masked_tokens(server, client):
    """Without speculation each constrained token is one mask: the counter equals the
    completion tokens of the constrained answers this server gave (the free text ones add
    nothing)."""

    def scraped(name: str) -> float:
        text = server.runner.metrics.registry.get_sample_value(name, {"model_name": "tiny"})
        return text or 0.0

    before = scraped("kitchen_serve_grammar_tokens_total")
    seconds = scraped("kitchen_serve_grammar_seconds_total")
    tokens = 0
    for seed in range(3):
        tokens += chat(client, "who?", person_format(), seed=seed).usage.completion_tokens
    # A free-text answer after them: its report comes after theirs, counters included.
    client.completions.create(model="tiny", prompt="free", max_tokens=5)
    assert scraped("kitchen_serve_grammar_tokens_total") - before == tokens
    assert scraped("kitchen_serve_grammar_seconds_total") > seconds


@pytest.mark.parametrize("kind", ["bpe", "cl100k"])
def test_the_grammar_reads_each_kitchen_tokenizer(tokenizer, kind):
    """The masks allow exactly the tokenizer's own spelling of a valid answer (every token of
    it, in turn), and refuse a token that would break it: the trained BPE (its tokenizer.json)
    and cl100k (its bytes per id)."""
    tok = tokenizer if kind == "bpe" else cl100k()
    grammars = Grammars(grammar_vocabulary(tok))
    matcher = grammars.matcher(Constraint(Format.JSON_SCHEMA, json.dumps(PERSON)))
    answer = '{"name":"Ada","age":36,"cook":true,"dishes":["soup","pie"]}'
    first = matcher.allowed(tok.vocab_size, torch.device("cpu"))
    assert not first[tok.encode("[")[0]] and not first[tok.encode("a")[0]]  # an object first
    for token in tok.encode(answer):
        allowed = matcher.allowed(tok.vocab_size, torch.device("cpu"))
        assert allowed[token], tok.decode([token])
        matcher.accept(token)
    assert matcher.allowed(tok.vocab_size, torch.device("cpu")).nonzero().flatten().tolist() == [
        tok.eos_id
    ]
