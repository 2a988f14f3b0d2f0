"""What one request may ask (#31, #36), on a live server on 127.0.0.1 with the official
`openai` client and raw HTTP: unknown and unimplemented fields refused by name, NaN, the
prompt's and the stop list's limits (checked before tokenizing; a long prompt tokenized off the
event loop), OpenAI's error object for every refusal, and non-streaming clients that give up
freeing their KV blocks at once."""

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest
import torch

from trainer.inference.testing import VOCAB, encode, tiny_model
from trainer.serve.api import INLINE_TOKENIZE_CHARS
from trainer.serve.requests import NOT_SUPPORTED
from trainer.serve.testing import start_server

torch.set_num_threads(1)

MAX_PROMPT = INLINE_TOKENIZE_CHARS + 1000  # room for a prompt tokenized on a worker thread
encoded_on: list[str] = []  # the thread of each encode call


def recording_encode(text: str) -> list[int]:
    encoded_on.append(threading.current_thread().name)
    return encode(text)


@pytest.fixture(scope="module")
def server():
    s = start_server(tiny_model(128), encode=recording_encode, max_prompt_chars=MAX_PROMPT)
    yield s
    assert s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.endpoint + "/v1", api_key="-", max_retries=0)


def raw(server, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    url = urlparse(server.endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    reply = json.loads(response.read())
    conn.close()
    return response.status, reply


def refusal(call) -> dict:
    """The error object of a call the server answers 400."""
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    return err.value.body


def test_an_unknown_field_is_refused_by_name(client):
    error = refusal(
        lambda: client.completions.create(
            model="tiny", prompt="a", max_tokens=2, extra_body={"frobnicate": True}
        )
    )
    assert error["param"] == "frobnicate" and "unrecognized" in error["message"]
    error = refusal(
        lambda: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a", "mood": "x"}], max_tokens=2
        )
    )
    assert error["param"] == "messages.0.mood"


@pytest.mark.parametrize(
    "chat, field, value",
    [
        (False, "echo", True),
        (False, "presence_penalty", 0.5),
        (False, "frequency_penalty", -1.0),
        (False, "logit_bias", {"3": 5}),
        (False, "best_of", 3),
        (True, "modalities", ["text", "audio"]),
        (True, "tools", [{"type": "function", "function": {"name": "f"}}]),
    ],
)
def test_an_unimplemented_field_is_refused_as_not_supported(client, chat, field, value):
    assert field in NOT_SUPPORTED
    if chat:
        messages = [{"role": "user", "content": "a"}]
        call = lambda: client.chat.completions.create(  # noqa: E731
            model="tiny", messages=messages, max_tokens=2, **{field: value}
        )
    else:
        call = lambda: client.completions.create(  # noqa: E731
            model="tiny", prompt="a", max_tokens=2, **{field: value}
        )
    error = refusal(call)
    assert error["param"] == field and error["message"] == f"{field}: not supported by this server"


def test_unimplemented_fields_that_ask_for_nothing_are_accepted(client):
    """What clients that fill in every field send (LangChain sends penalties of 0)."""
    got = client.completions.create(
        model="tiny",
        prompt="a",
        max_tokens=2,
        presence_penalty=0,
        frequency_penalty=0.0,
        echo=False,
        logprobs=None,
        logit_bias={},
        user="someone",
    )
    assert got.choices[0].finish_reason in ("stop", "length")


def test_an_answer_passed_back_as_it_came_is_a_message(client):
    """A chat's earlier answer, passed back whole (`choices[0].message`), has empty tool and
    refusal fields: accepted. A tool call in it is not."""
    first = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=2
    )
    answer = first.choices[0].message.model_dump()
    assert "tool_calls" in answer and "refusal" in answer
    messages = [{"role": "user", "content": "a"}, answer, {"role": "user", "content": "b"}]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert got.choices[0].finish_reason in ("stop", "length")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages[1] = {**answer, "tool_calls": [call]}
    error = refusal(
        lambda: client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    )
    assert error["param"] == "messages.1.tool_calls" and "not supported" in error["message"]


def test_nan_temperature_is_refused_as_not_finite(server):
    # JSON has no NaN, but Python's json reads it (and the openai client cannot send it)
    body = b'{"model": "tiny", "prompt": "a", "temperature": NaN}'
    status, reply = raw(server, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "temperature"
    assert reply["error"]["message"] == "temperature: Input should be a finite number"
    body = b'{"model": "tiny", "prompt": "a", "top_p": Infinity}'
    status, reply = raw(server, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "top_p"


def test_unknown_route_and_method_get_the_openai_error_object(server):
    status, reply = raw(server, "GET", "/v1/engines")
    assert status == 404 and reply["error"]["message"] == "Not Found"
    status, reply = raw(server, "GET", "/v1/completions")
    assert status == 405 and reply["error"]["type"] == "invalid_request_error"


def test_a_prompt_over_the_limit_is_refused_before_tokenizing(client):
    encoded_on.clear()
    error = refusal(lambda: client.completions.create(model="tiny", prompt="x" * (MAX_PROMPT + 1)))
    assert error["param"] == "prompt" and "serve.max_prompt_chars" in error["message"]
    assert f"{MAX_PROMPT + 1:,} characters" in error["message"]
    messages = [{"role": "user", "content": "x" * (MAX_PROMPT // 2 + 1)}] * 2
    error = refusal(lambda: client.chat.completions.create(model="tiny", messages=messages))
    assert error["param"] == "messages" and "serve.max_prompt_chars" in error["message"]
    assert encoded_on == []  # neither reached the tokenizer


def test_a_long_prompt_is_tokenized_off_the_event_loop(client):
    encoded_on.clear()
    client.completions.create(model="tiny", prompt="short", max_tokens=1)
    error = refusal(  # under the character limit, over the model's context once tokenized
        lambda: client.completions.create(model="tiny", prompt="x" * MAX_PROMPT, max_tokens=1)
    )
    assert error["param"] == "prompt" and "the model's context is 128" in error["message"]
    assert encoded_on[0] == "serve-http"  # the event loop's thread: microseconds
    assert encoded_on[1] != "serve-http"  # a worker thread: the loop serves other clients


@pytest.mark.parametrize(
    "stop, message",
    [
        (["a", "b", "c", "d", "e"], "stop: 5 stop strings; at most 4 (serve.max_stop)"),
        (["ok", "y" * 257], "stop[1]: 257 characters; at most 256 (serve.max_stop_chars)"),
    ],
)
def test_the_stop_list_is_bounded(server, stop, message):
    body = json.dumps({"model": "tiny", "prompt": "a", "stop": stop}).encode()
    status, reply = raw(server, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": "stop",
        "code": None,
    }


def test_abandoned_non_streaming_requests_free_their_blocks_at_once():
    """Five clients ask for long answers, then go away while tokens are still flowing: each
    request is aborted (not run to its end) and every KV block is free again within seconds."""
    server = start_server(tiny_model(1024), eos_id=VOCAB, num_blocks=512)  # never ends early
    try:
        url = urlparse(server.endpoint)
        body = json.dumps({"model": "tiny", "prompt": "go", "max_tokens": 1000}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sockets = [socket.create_connection((url.hostname, url.port)) for _ in range(5)]
        for sock in sockets:
            sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while server.runner.load().running_requests < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.runner.load().kv_blocks_used > 0
        generated = server.runner.generated
        for sock in sockets:
            sock.close()
        deadline = time.monotonic() + 10
        while server.runner.load().kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.05)
        load = server.runner.load()
        assert load.running_requests == load.waiting_requests == load.kv_blocks_used == 0
        assert server.runner.generated - generated < 5 * 1000  # none ran to its end
        text = metrics_text(server)
        assert 'kitchen_serve_requests_total{finish_reason="abort",model_name="tiny"} 5.0' in text
        assert 'finish_reason="length"' not in text
    finally:
        assert server.stop()


def metrics_text(server) -> str:
    url = urlparse(server.endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text
