"""A live serve job's parts for tests: a Server of a model on 127.0.0.1 with the toy tokenizer
(trainer/inference/testing.py), and the endpoint a `serve` job process logs."""

import re
import time

from trainer.inference.testing import BOS, EOS, decode, encode, serve_config
from trainer.model import Transformer


def start_server(
    model: Transformer,
    name: str = "tiny",
    eos_id: int = EOS,
    encode=encode,
    draft: Transformer | None = None,
    **serve,
):
    """A live Server of `model` on 127.0.0.1 (any free port) with the toy tokenizer (`encode`:
    e.g. one that records its calls); an `eos_id` outside the vocabulary makes every request
    run to max_tokens. `draft`: speculative decoding's draft model. `serve`: ServeConfig
    fields."""
    from trainer.serve.api import ServedModel
    from trainer.serve.server import Server

    served = ServedModel(name, encode, BOS, model.rope.cos.shape[0], created=0)
    cfg = serve_config(**serve)
    return Server(model, cfg, served, decode=decode, eos_id=eos_id, draft=draft).start()


def wait_for_endpoint(log_path, process, timeout=60.0) -> str:
    """The endpoint a `serve` job process logs once it listens (it must not exit first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"serving on (http://\S+)/v1", log_path.read_text())
        if found:
            return found.group(1)
        assert process.poll() is None, log_path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no endpoint within {timeout} s:\n{log_path.read_text()}")
