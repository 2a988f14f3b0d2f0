"""Defaults and checks for kitchen.v1.DataConfig: the one place either lives for the data section.

`with_defaults(cfg)` returns a copy with every unset optional field and UNSPECIFIED enum set to
the default documented beside it in protos/trainer_config.proto; `validate(cfg)` raises a
DataConfigError naming the first field that cannot work. trainer/config.py calls both for
`TrainerConfig.data`.
"""

import os

from trainer.data.errors import DataConfigError

DEFAULTS = {
    "text_field": "text",
    "prompt_field": "prompt",
    "response_field": "response",
    "vocab_size": 4096,
    "seq_len": 256,
    "shard_tokens": 16 * 1024 * 1024,
    "eval_fraction": 0.02,
    "max_documents": 0,
}

ENUM_DEFAULTS = {"format": "TEXT_FILES", "tokenizer": "BPE_TRAIN", "packing": "BEST_FIT"}

# A byte-level BPE starts from 256 byte tokens plus <|bos|>, <|eos|>, <|pad|>.
BYTE_ALPHABET = 256
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
MIN_BPE_VOCAB = BYTE_ALPHABET + len(SPECIAL_TOKENS)


def enum_name(cfg, field: str) -> str:
    """The name of an enum field's value, e.g. enum_name(cfg, "packing") == "BEST_FIT"."""
    values = cfg.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number
    return values[getattr(cfg, field)].name


def enum_value(cfg, field: str, name: str) -> int:
    """The number of enum value `name` (case-insensitive) of `field`, or DataConfigError."""
    values = cfg.DESCRIPTOR.fields_by_name[field].enum_type.values_by_name
    key = name.upper()
    if key not in values or key.endswith("_UNSPECIFIED"):
        choices = ", ".join(v for v in values if not v.endswith("_UNSPECIFIED"))
        raise DataConfigError(field, f"{name!r} is not one of {choices}")
    return values[key].number


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def with_defaults(cfg):
    """A copy of `cfg` (a DataConfig) with every default applied; `cfg` is not changed."""
    out = type(cfg)()
    out.CopyFrom(cfg)
    for name, value in DEFAULTS.items():
        if not out.HasField(name):
            setattr(out, name, value)
    for name, value in ENUM_DEFAULTS.items():
        if getattr(out, name) == 0:
            setattr(out, name, enum_value(out, name, value))
    if not out.HasField("workers"):
        out.workers = default_workers()
    return out


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise DataConfigError(field, problem)


def validate(cfg) -> None:
    """Raise DataConfigError for the first field of a defaulted DataConfig that cannot work."""
    _check(cfg.seq_len >= 2, "seq_len", f"{cfg.seq_len} must be at least 2 tokens")
    if enum_name(cfg, "tokenizer") == "BPE_TRAIN":
        _check(
            cfg.vocab_size >= MIN_BPE_VOCAB,
            "vocab_size",
            f"{cfg.vocab_size} cannot fit a byte-level BPE: it needs at least {MIN_BPE_VOCAB} "
            f"tokens ({BYTE_ALPHABET} bytes + {len(SPECIAL_TOKENS)} special tokens)",
        )
    if enum_name(cfg, "tokenizer") == "BPE_FILE":
        _check(bool(cfg.tokenizer_path), "tokenizer_path", "is required when tokenizer is BPE_FILE")
    _check(
        cfg.shard_tokens >= cfg.seq_len,
        "shard_tokens",
        f"{cfg.shard_tokens} is smaller than one row (seq_len {cfg.seq_len})",
    )
    _check(cfg.workers >= 1, "workers", f"{cfg.workers} must be at least 1")
    _check(0 <= cfg.eval_fraction < 1, "eval_fraction", f"{cfg.eval_fraction:g} not in [0, 1)")
    _check(cfg.max_documents >= 0, "max_documents", f"{cfg.max_documents} is negative")
    fmt = enum_name(cfg, "format")
    if fmt == "JSONL":
        _check(bool(cfg.text_field), "text_field", "must name the JSON field holding the text")
    if fmt == "JSONL_CHAT":
        _check(bool(cfg.prompt_field), "prompt_field", "must name the JSON prompt field")
        _check(bool(cfg.response_field), "response_field", "must name the JSON response field")
        _check(
            cfg.prompt_field != cfg.response_field,
            "response_field",
            f"is the same field as prompt_field ({cfg.prompt_field!r})",
        )


def resolve(cfg):
    """with_defaults + validate: the DataConfig precook actually runs with."""
    out = with_defaults(cfg)
    validate(out)
    return out
