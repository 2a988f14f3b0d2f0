"""A tiny model for inference and serving tests: random weights spread wide enough that greedy
decoding's argmax is decided by the model, not by float rounding (the paged attention and the
full forward add in different orders) and that the next token depends on the whole context,
and a toy tokenizer."""

import torch

from protos import defaults, trainer_config_pb2
from trainer.model import Transformer

VOCAB = 64
EOS = VOCAB - 1
BOS = VOCAB - 2


def tiny_model(max_seq_len: int = 96, seed: int = 0, vocab: int = VOCAB) -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 32, 2, 4, 2
    cfg.model.max_seq_len = max_seq_len
    cfg.model.use_kernels = False
    torch.manual_seed(seed)
    model = Transformer(defaults.with_defaults(cfg).model, vocab)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def perturbed(target: Transformer, noise: float, max_seq_len: int) -> Transformer:
    """A draft model for speculative decoding: tiny_model's shape, with the target's weights
    plus Gaussian noise of std `noise` (after tiny_model's seed: the same draft every time), so
    that it agrees with the target often, not always."""
    draft = tiny_model(max_seq_len)
    with torch.no_grad():
        for d, t in zip(draft.parameters(), target.parameters(), strict=True):
            d.copy_(t + noise * torch.randn_like(t))
    return draft


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


@torch.no_grad()
def greedy_full_forward(model: Transformer, prompt: list[int], n: int, stop: int | None = None):
    """Greedy continuation of `prompt` with no cache at all: the whole sequence through the
    model for every token, the reference a cached decode must equal. Ends after the stop
    token (kept), n tokens, or the model's last position."""
    ids, limit = list(prompt), model.rope.cos.shape[0]
    for _ in range(n):
        if len(ids) >= limit:
            break
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        ids.append(int(logits.argmax()))
        if ids[-1] == stop:
            break
    return ids[len(prompt) :]


# Structured-output tests: the toy vocabulary read as JSON's characters, one per id (BOS and EOS
# special), so that a grammar over it (trainer/inference/grammar.py) can spell any compact JSON
# answer with small numbers and lowercase strings.
JSON_CHARS = '{}[]":,-.0123456789 abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOP'
assert len(JSON_CHARS) == BOS


def json_decode(ids: list[int]) -> str:
    return "".join(JSON_CHARS[i] for i in ids if i not in (BOS, EOS))


def json_encode(text: str) -> list[int]:
    return [JSON_CHARS.index(c) for c in text]


def json_vocabulary():
    """The grammar's view of the toy JSON vocabulary."""
    from trainer.inference.grammar import Vocabulary

    tokens = tuple(c.encode() for c in JSON_CHARS) + (b"", b"")
    return Vocabulary(VOCAB, EOS, tokens=tokens, special_ids=(BOS, EOS), encode=json_encode)
