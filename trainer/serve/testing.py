"""A tiny model for serving tests: random weights spread wide enough that greedy decoding's
argmax is decided by the model, not by float rounding (the paged and the contiguous attention
add in different orders), and a toy detokenizer."""

import re
import time

import torch

from protos import defaults, trainer_config_pb2
from trainer.model import Transformer

VOCAB = 64
EOS = VOCAB - 1
BOS = VOCAB - 2


def tiny_model(max_seq_len: int = 96, seed: int = 0) -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 32, 2, 4, 2
    cfg.model.max_seq_len = max_seq_len
    cfg.model.use_kernels = False
    torch.manual_seed(seed)
    model = Transformer(defaults.with_defaults(cfg).model, VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def decode(ids: list[int]) -> str:
    """One letter per token id (BOS and EOS are no text)."""
    return "".join(chr(ord("a") + i % 26) for i in ids if i not in (BOS, EOS))


def encode(text: str) -> list[int]:
    """One token per character; a-z are ids 0-25."""
    return [(ord(c) - ord("a")) % 26 for c in text]


def serve_config(**fields) -> trainer_config_pb2.ServeConfig:
    """A ServeConfig with defaults applied and `fields` set."""
    cfg = trainer_config_pb2.TrainerConfig()
    for name, value in fields.items():
        setattr(cfg.serve, name, value)
    return defaults.with_defaults(cfg).serve


def start_server(model: Transformer, name: str = "tiny", eos_id: int = EOS, **serve):
    """A live Server of `model` on 127.0.0.1 (any free port) with the toy tokenizer; an
    `eos_id` outside the vocabulary makes every request run to max_tokens."""
    from trainer.serve.api import ServedModel
    from trainer.serve.server import Server

    served = ServedModel(name, encode, BOS, model.rope.cos.shape[0], created=0)
    return Server(model, serve_config(**serve), served, decode=decode, eos_id=eos_id).start()


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
