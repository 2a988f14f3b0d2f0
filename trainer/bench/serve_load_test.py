"""The load generator against a live server: records for every request, connections kept alive
from one request to the next, and a refused request raised with its status."""

import pytest
import torch

from trainer.bench import serve_load as load
from trainer.inference.testing import VOCAB, tiny_model
from trainer.serve.testing import start_server

torch.set_num_threads(1)


KEY = "sk-load-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "serve.key"
    key_file.write_text(KEY)
    # never ends early (max_tokens every time); asks for the API key
    s = start_server(tiny_model(), eos_id=VOCAB, api_key_file=str(key_file))
    yield s
    assert s.stop()


def test_every_request_is_recorded_over_one_connection_per_client(server, monkeypatch):
    opened = []
    connect = load.socket.create_connection

    def counted(*args, **kwargs):
        opened.append(args)
        return connect(*args, **kwargs)

    monkeypatch.setattr(load.socket, "create_connection", counted)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0}
    wall, records = load.run_clients(server.endpoint, body, clients=2, each=3, api_key=KEY)
    assert len(opened) == 2  # one per client, kept alive for its three requests
    assert len(records) == 6 and wall > 0
    for r in records:
        assert r.tokens == 5  # as the server counted them
        assert 1 <= len(r.chunk_times) <= 5  # an event per token with text (BOS, EOS have none)
        assert r.sent < r.chunk_times[0] <= r.chunk_times[-1]
    result = load.summarize(2, wall, records)
    assert result.requests == 6 and result.tokens_per_s > 0


def test_a_refused_request_raises_with_its_status(server):
    body = {"model": "no-such-model", "prompt": "abc", "max_tokens": 5}
    with pytest.raises(RuntimeError, match="HTTP 404"):
        load.run_clients(server.endpoint, body, clients=1, each=2, api_key=KEY)
    body["model"] = "tiny"
    with pytest.raises(RuntimeError, match="HTTP 401"):
        load.run_clients(server.endpoint, body, clients=1, each=2)  # no key
