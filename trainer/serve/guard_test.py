"""The serve endpoint's gate (#31), on a live server on 127.0.0.1: the API key with the
official `openai` client, HTTPS, and with raw sockets what clients should not get away with:
a body longer than the limit, a body that is not UTF-8, a request sent a byte at a time, a
connection kept idle."""

import json
import socket
import ssl
import subprocess
import time
from urllib.parse import urlparse

import openai
import pytest
import torch

from protos.config_yaml import ConfigError
from trainer.inference.testing import serve_config, tiny_model
from trainer.serve.server import api_key
from trainer.serve.testing import start_server

torch.set_num_threads(1)

KEY = "sk-kitchen-0123456789abcdef"
MAX_BODY = 65536
REQUEST_TIMEOUT = 2.0
IDLE_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "serve.key"
    path.write_text(KEY + "\n")
    return path


@pytest.fixture(scope="module")
def server(key_file):
    s = start_server(
        tiny_model(128),
        api_key_file=str(key_file),
        max_body_bytes=MAX_BODY,
        request_timeout_seconds=REQUEST_TIMEOUT,
        idle_timeout_seconds=IDLE_TIMEOUT,
    )
    yield s
    assert s.stop()


def connect(server) -> socket.socket:
    url = urlparse(server.endpoint)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def exchange(server, head: str, body: bytes = b"") -> tuple[int, dict, float]:
    """Sends `head` (request line and headers, without the blank line) and `body`; the status,
    the JSON answer and the seconds until the connection closed."""
    with connect(server) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        return read_answer(sock)


def read_answer(sock: socket.socket) -> tuple[int, dict, float]:
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, content = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(content), time.monotonic() - start


def post_head(path: str, length: int, key: str = KEY) -> str:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {length}"
    )


def test_the_openai_client_needs_the_api_key(server):
    good = openai.OpenAI(base_url=server.endpoint + "/v1", api_key=KEY, max_retries=0)
    got = good.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0)
    assert got.choices[0].finish_reason in ("stop", "length")
    for wrong in ("sk-wrong", KEY[:-1], KEY + "x"):
        client = openai.OpenAI(base_url=server.endpoint + "/v1", api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.completions.create(model="tiny", prompt="ab", max_tokens=3)
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key", err.value.body
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_no_key_is_401_with_the_openai_error_object_and_health_stays_open(server):
    body = json.dumps({"model": "tiny", "prompt": "ab"}).encode()
    head = post_head("/v1/completions", len(body)).replace(f"Authorization: Bearer {KEY}\r\n", "")
    status, reply, _ = exchange(server, head, body)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in reply["error"]["message"]
    status, reply, _ = exchange(server, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close")
    assert status == 200 and reply["status"] == "ok"


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """The Content-Length says 1 GB and no byte of it is sent: the answer comes anyway."""
    status, reply, _ = exchange(server, post_head("/v1/completions", 1 << 30))
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert "1,073,741,824 bytes" in reply["error"]["message"]
    assert "serve.max_body_bytes" in reply["error"]["message"]


def test_a_chunked_body_over_the_limit_is_cut_off(server):
    head = post_head("/v1/completions", 0).replace(
        "Content-Length: 0", "Transfer-Encoding: chunked"
    )
    with connect(server) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n")
        chunk = b'{"prompt": "' + b"x" * 16384
        try:
            # well past the limit and never finished: a server that closes as it answers
            # resets the connection on the bytes still coming, and the answer is lost
            for _ in range(MAX_BODY // len(chunk) + 32):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:  # the server answered and closed while we were still sending
            pass
        status, reply, _ = read_answer(sock)
    assert status == 400 and "serve.max_body_bytes" in reply["error"]["message"]


def test_a_body_that_is_not_utf8_gets_the_openai_error_object(server):
    body = b'{"model": "tiny", "prompt": "caf\xe9"}'
    status, reply, _ = exchange(server, post_head("/v1/completions", len(body)), body)
    assert status == 400 and set(reply) == {"error"}
    assert reply["error"]["message"] == "the body is not UTF-8 text: byte 32 is 0xe9"


def test_a_client_that_sends_its_request_slowly_is_cut_off(server):
    """Slowloris: headers a byte at a time, a body that never ends, or nothing at all: each
    connection is closed once the request timeout has passed since it began."""
    head = post_head("/v1/completions", 100).encode() + b"\r\n\r\n"
    for sent in (b"", head[:20], head + b'{"model": '):
        with connect(server) as sock:
            start = time.monotonic()
            sock.sendall(sent)
            sock.settimeout(REQUEST_TIMEOUT + 15)
            assert sock.recv(1024) == b"", sent  # closed by the server, not by our timeout
            assert time.monotonic() - start >= REQUEST_TIMEOUT * 0.9, sent


def test_an_idle_kept_alive_connection_is_closed(server):
    head = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):  # the whole answer
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        sock.settimeout(IDLE_TIMEOUT + 15)
        assert sock.recv(1024) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - start < IDLE_TIMEOUT + 10  # uvicorn's default is 5 s


def test_https_with_the_key(tmp_path, key_file):
    cert, private = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", private, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    server = start_server(
        tiny_model(128), api_key_file=str(key_file), tls_cert=str(cert), tls_key=str(private)
    )
    try:
        assert server.endpoint.startswith("https://127.0.0.1:")
        client = openai.OpenAI(
            base_url=server.endpoint + "/v1",
            api_key=KEY,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert)),
        )
        got = client.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0)
        assert got.choices[0].finish_reason in ("stop", "length")
        plain = openai.OpenAI(
            base_url=server.endpoint.replace("https", "http") + "/v1", api_key=KEY, max_retries=0
        )
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()
    finally:
        assert server.stop()


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch, key_file):
    assert api_key(serve_config()) == ""
    assert api_key(serve_config(api_key_file=str(key_file))) == KEY  # the newline dropped
    monkeypatch.setenv("KITCHEN_SERVE_TEST_KEY", KEY)
    assert api_key(serve_config(api_key_env="KITCHEN_SERVE_TEST_KEY")) == KEY
    short = tmp_path / "short"
    short.write_text("abc")
    cases = {
        "api_key_file": (str(short), "trainer.serve.api_key_file: holds fewer than 16"),
        "api_key_env": ("KITCHEN_SERVE_UNSET", "api_key_env: environment variable KITCHEN_"),
    }
    for field, (value, message) in cases.items():
        with pytest.raises(ConfigError) as err:
            api_key(serve_config(**{field: value}))
        assert message in str(err.value)
    with pytest.raises(ConfigError, match="api_key_file: cannot read"):
        api_key(serve_config(api_key_file=str(tmp_path / "missing")))
