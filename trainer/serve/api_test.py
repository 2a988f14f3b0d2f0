"""A live server on 127.0.0.1, called with the official `openai` client (completions, chat,
streaming) and with raw HTTP for the error cases, overload and a client that goes away."""

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest
import torch

from protos.config_yaml import ConfigError
from trainer.generate import generate
from trainer.inference.sampling import sample
from trainer.inference.testing import BOS, EOS, VOCAB, decode, encode, serve_config, tiny_model
from trainer.serve.engine_process import dumps
from trainer.serve.runner import Latency
from trainer.serve.server import serve
from trainer.serve.testing import start_server

torch.set_num_threads(1)  # tiny ops: several threads only spin on a shared machine

MAX_LEN = 128


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


@pytest.fixture(scope="module")
def server(model):
    s = start_server(model, max_waiting=64)
    yield s
    assert s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.endpoint + "/v1", api_key="unused", max_retries=0)


def greedy_text(model, text: str, max_tokens: int) -> str:
    out, _ = generate(
        model, [BOS, *encode(text)], max_tokens, temperature=0, stop_id=EOS, max_len=MAX_LEN
    )
    return decode(out)


def raw(server, method: str, path: str, body: bytes | None = None):
    url = urlparse(server.endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data) if data else None


def post(server, path: str, body: dict):
    return raw(server, "POST", path, json.dumps(body).encode())


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, body = raw(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok"


def test_completion_greedy_equals_generate(client, model):
    got = client.completions.create(model="tiny", prompt="kitchen", max_tokens=24, temperature=0)
    choice = got.choices[0]
    assert choice.text == greedy_text(model, "kitchen", 24)[: len(choice.text)]
    assert choice.finish_reason in ("stop", "length")
    assert got.usage.prompt_tokens == 1 + len("kitchen")


def test_chat_uses_the_sft_format(client, model):
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "what is a block"}],
        max_tokens=20,
        temperature=0,
    )
    message = got.choices[0].message
    assert message.role == "assistant"
    assert message.content == greedy_text(model, "what is a block", 20)


def test_streaming_completion_and_chat_add_up_to_the_whole_answer(client, model):
    want = greedy_text(model, "stream", 30)
    stream = client.completions.create(
        model="tiny", prompt="stream", max_tokens=30, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) == want and len(pieces) > 1
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=30,
        temperature=0,
        stream=True,
    )
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_connections_stay_alive_with_nagle_off(server):
    """A client keeps its connection from one request to the next (the openai client does),
    and the server's side of it sends each streamed event at once: with Nagle's algorithm on, a
    small write waits for the ACK of the one before, which a client delays up to 40 ms."""
    url = urlparse(server.endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        body = json.dumps({"model": "tiny", "prompt": "ab", "max_tokens": 3, "stream": True})
        for _ in range(2):
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200 and response.getheader("connection") != "close"
            assert response.read().endswith(b"data: [DONE]\n\n")
        sockets = [
            c.transport.get_extra_info("socket") for c in server.http.server_state.connections
        ]
        assert sockets, "the connection is still open"
        for sock in sockets:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        conn.close()


def test_greedy_inside_a_full_batch_equals_generate(server, model):
    prompts = [f"request{'x' * i}" for i in range(12)]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        client = openai.OpenAI(base_url=server.endpoint + "/v1", api_key="-", max_retries=0)
        got = client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=40, temperature=0
        )
        results[i] = got.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert results[i] == greedy_text(model, p, 40)[: len(results[i])], p
        assert results[i] == greedy_text(model, p, 40), p


@torch.no_grad()
def sampled_full_forward(model, text: str, n: int, seed: int, temperature: float) -> str:
    """Seeded sampling with no cache at all: the whole sequence through the model for each
    token, drawn as the engine draws (sampling.sample with a generator seeded by the request's
    seed): what a served request with that seed must say, whatever else is in its batch."""
    generator = torch.Generator().manual_seed(seed)
    prompt = [BOS, *encode(text)]
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1:]
        ids.append(sample(logits, [temperature], [0], [1.0], [generator])[0])
        if ids[-1] == EOS:
            break
    return decode(ids[len(prompt) :])


def test_seeded_sampling_inside_a_full_batch_equals_a_cache_free_forward(server, model):
    """Sampling follows the whole distribution, so a KV cache that gathers a wrong block (or
    another request's) changes the draws within a few tokens, where greedy text of a weak
    model may survive it. Prompts cross block boundaries (16 tokens); each request has its
    own seed, and none equals another's text by chance."""
    prompts = {seed: "seeded" + "abcdefghij"[: seed % 10] * (seed % 4 + 1) for seed in range(10)}
    results: dict[int, str] = {}

    def ask(seed: int) -> None:
        client = openai.OpenAI(base_url=server.endpoint + "/v1", api_key="-", max_retries=0)
        got = client.completions.create(
            model="tiny", prompt=prompts[seed], max_tokens=40, temperature=1.0, seed=seed
        )
        results[seed] = got.choices[0].text

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, prompt in prompts.items():
        assert results[seed] == sampled_full_forward(model, prompt, 40, seed, 1.0), prompt
    assert len(set(results.values())) == len(prompts)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny", "prompt": "x" * MAX_LEN}, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": MAX_LEN}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": "x", "n": 2}, "n"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    status, reply = post(server, "/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param and param in reply["error"]["message"]


def test_text_parts_are_the_text_and_an_image_is_400_for_a_text_model(client, model, server):
    parts = [{"type": "text", "text": "what is "}, {"type": "text", "text": "a block"}]
    got = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=20, temperature=0
    )
    assert got.choices[0].message.content == greedy_text(model, "what is a block", 20)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message = {"role": "user", "content": [parts[0], image]}
    status, reply = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [message]})
    param = "messages[0].content[1].image_url.url"
    assert status == 400 and reply["error"]["param"] == param
    assert "text model" in reply["error"]["message"]


def test_bad_chat_and_unknown_model_and_malformed_json(server):
    status, reply = post(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "robot", "content": ""}]},
    )
    assert status == 400 and reply["error"]["param"] == "messages.0.role"
    status, reply = post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert (
        status == 404
        and reply["error"]["param"] == "model"
        and "gpt-9" in reply["error"]["message"]
    )
    status, reply = raw(server, "POST", "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "JSON" in reply["error"]["message"]


def test_overload_is_429_and_every_accepted_request_completes(model):
    server = start_server(model, max_waiting=2, max_running=2)
    statuses: list[tuple[int, dict]] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        result = post(
            server,
            "/v1/completions",
            {"model": "tiny", "prompt": f"p{i}", "max_tokens": 60, "temperature": 0},
        )
        with lock:
            statuses.append(result)

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        assert server.stop()
    codes = sorted(s for s, _ in statuses)
    assert len(codes) == 24 and set(codes) <= {200, 429} and 429 in codes and 200 in codes
    for status, body in statuses:
        if status == 429:
            assert body["error"]["type"] == "rate_limit_exceeded"
        else:
            assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(model):
    server = start_server(tiny_model(1024), eos_id=VOCAB, num_blocks=128)  # never ends early
    try:
        url = urlparse(server.endpoint)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        body = {
            "model": "tiny",
            "prompt": "go",
            "max_tokens": 1000,
            "temperature": 1.0,
            "stream": True,
        }
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # streaming has begun
        assert server.runner.load().kv_blocks_used > 0
        conn.sock.close()  # the client goes away
        conn.close()
        deadline = time.monotonic() + 20
        while server.runner.load().running_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        load = server.runner.load()
        assert load.running_requests == load.waiting_requests == load.kv_blocks_used == 0
        text = http_get_text(server, "/metrics")
        assert 'kitchen_serve_requests_total{finish_reason="abort",model_name="tiny"} 1.0' in text
    finally:
        assert server.stop()


def http_get_text(server, path: str) -> str:
    url = urlparse(server.endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def test_metrics_and_heartbeat_latency_window(client, server):
    server.runner.window_latency()  # start a fresh window
    client.completions.create(model="tiny", prompt="window", max_tokens=5, temperature=0)
    window = server.runner.window_latency()
    assert 0 < window.ttft_p50_seconds <= window.ttft_p99_seconds
    assert 0 < window.itl_p50_seconds <= window.itl_p99_seconds
    assert server.runner.window_latency() == Latency(0.0, 0.0, 0.0, 0.0)  # nothing since
    text = http_get_text(server, "/metrics")
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert f'kitchen_serve_{name}_count{{model_name="tiny"}}' in text
    beat = server.heartbeat("j1", 1)
    assert beat.endpoint == server.endpoint and beat.kv_blocks_free > 0


def test_the_engine_process_maps_the_weights_it_does_not_copy_them(server, model):
    """The model went to the engine process as shared memory (CUDA IPC handles on a GPU): what
    the pipe carried is a few kilobytes of handles, not the megabytes of weights."""
    assert all(p.is_shared() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(dumps(model)) < weights / 10


def test_an_engine_process_that_dies_ends_open_requests_and_refuses_new_ones(model):
    server = start_server(model, eos_id=VOCAB)  # never ends early
    client = openai.OpenAI(base_url=server.endpoint + "/v1", api_key="unused", max_retries=0)
    try:
        stream = client.completions.create(
            model="tiny", prompt="go", max_tokens=100, temperature=1.0, stream=True
        )
        chunks = [next(iter(stream))]  # streaming has begun
        server.runner.process.kill()  # a crash, the OOM killer
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "abort"
        assert "exited with code -9" in server.runner.failed
        status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": "a"})
        assert status == 503 and "exited with code -9" in body["error"]["message"]
    finally:
        assert not server.stop()  # the engine's requests did not all finish


def test_a_request_the_kv_pool_cannot_hold_is_a_400_and_others_are_served(model):
    """#36: 8 blocks of 4 tokens (32 positions) under a 128-token context. A request longer
    than the pool would take every block, be preempted and recomputed forever, holding back
    everyone: it is refused, naming the field, and a request that fits is served."""
    server = start_server(model, num_blocks=8, block_size=4)
    try:
        body = {"model": "tiny", "prompt": "x" * 10, "max_tokens": 40, "temperature": 0}
        status, reply = post(server, "/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == "max_tokens", reply
        assert "KV-cache pool of 32 positions" in reply["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40}]}
        status, reply = post(server, "/v1/chat/completions", {**chat, "max_tokens": 2})
        assert status == 400 and reply["error"]["param"] == "messages", reply
        status, reply = post(server, "/v1/completions", {**body, "max_tokens": 21})
        assert status == 200 and reply["usage"]["total_tokens"] <= 32
        assert reply["choices"][0]["text"] == greedy_text(model, "x" * 10, 21)
    finally:
        assert server.stop()


def test_the_serve_job_refuses_a_pool_smaller_than_the_checkpoints_context(model):
    """#36: the start-up check reads the checkpoint's context (`max_len`), not the config's."""
    cfg = serve_config(num_blocks=4, block_size=16)  # 64 positions for a 128-token checkpoint
    with pytest.raises(ConfigError, match="the checkpoint's context 128") as e:
        serve(model, None, MAX_LEN, cfg, None, print, None)  # type: ignore[arg-type]
    assert e.value.field == "trainer.serve.num_blocks"


def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(client, server):
    """Prefix caching: the second request with a 40-token prompt finds its first two full
    blocks (16 tokens each) in the cache; the last block is partial, so it is computed."""

    def cached_total() -> float:
        for line in http_get_text(server, "/metrics").splitlines():
            if line.startswith("kitchen_serve_prefix_cached_tokens_total{"):
                return float(line.split()[-1])
        raise AssertionError("no kitchen_serve_prefix_cached_tokens_total")

    prompt = "the same system prompt, then a question"  # 39 characters + BOS: 40 tokens
    before = cached_total()
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 40
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage][0]
    assert usage.prompt_tokens_details.cached_tokens == 32
    deadline = time.monotonic() + 5  # the gauges follow the engine's next report
    while cached_total() - before < 64 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cached_total() - before == 64
    beat = server.heartbeat("j1", 1)
    assert beat.prefix_cached_tokens >= 64 and beat.prompt_tokens >= 120


def forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The trainer's model forward: log_softmax at each generated token's position."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = model(ids, torch.arange(ids.shape[1])[None])[0].log_softmax(-1)
    return logp[len(prompt) - 1 : -1]


def test_logprobs_on_both_endpoints_are_the_models_log_softmax(client, server, model):
    """Seeded sampling at temperature 0.8 (its tokens depend on the draws, its logprobs are
    at temperature 1): each token's logprob and top alternatives equal the model forward's,
    whole and streamed."""
    prompt_ids = [BOS, *encode("score me")]
    got = client.completions.create(
        model="tiny", prompt="score me", max_tokens=10, temperature=0.8, seed=3, logprobs=2
    )
    lp = got.choices[0].logprobs
    output, _ = generate(  # the same seeded draws, alone: the answer's token ids
        model, prompt_ids, 10, temperature=0.8, top_k=0, top_p=1, seed=3, stop_id=EOS,
        max_len=MAX_LEN,
    )  # fmt: skip
    assert lp.tokens == [decode([t]) for t in output]
    assert "".join(lp.tokens) == got.choices[0].text
    want = forward_logprobs(model, prompt_ids, output)
    chosen = want.gather(1, torch.tensor(output)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), chosen, rtol=0, atol=1e-4)
    top_values, top_ids = want.topk(2, dim=-1)
    for i, alternatives in enumerate(lp.top_logprobs):
        assert list(alternatives) == [decode([t]) for t in top_ids[i].tolist()], i
        torch.testing.assert_close(
            torch.tensor(list(alternatives.values())), top_values[i], rtol=0, atol=1e-4
        )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(output))]

    messages = [{"role": "user", "content": "score me"}]
    ask = dict(model="tiny", messages=messages, max_tokens=10, temperature=0.8, seed=3)
    chat = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert [c.token for c in content] == lp.tokens  # the same prompt, seed and draws
    torch.testing.assert_close(
        torch.tensor([c.logprob for c in content]), chosen, rtol=0, atol=1e-4
    )
    assert [len(c.top_logprobs) for c in content] == [3] * len(content)
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(**ask)
    assert plain.choices[0].logprobs is None
    status, reply = post(server, "/v1/chat/completions", {**ask, "top_logprobs": 2})
    assert status == 400 and reply["error"]["param"] == "top_logprobs"
