"""Defaults and validation for TrainerConfig: the one place either lives.

`resolve(cfg, kind)` returns a copy of the config with every unset optional field filled in
(the defaults written beside each field in protos/trainer_config.proto) and every rule
checked, so that a bad config fails before any work starts with a message that names the
field: `trainer.model.n_heads: 6 does not divide dim 256`.
"""

from trainer.data import defaults as data_defaults
from trainer.data.defaults import enum_name, enum_value
from trainer.data.errors import DataConfigError

# Field defaults, as documented in protos/trainer_config.proto. The data section's live with
# precook (trainer/data/defaults.py, which precook also runs standalone); defaults that depend
# on other fields (n_kv_heads, ffn_dim, max_seq_len) or on the device (dtype) are below.
DEFAULTS = {
    "model": {
        "dim": 256,
        "n_layers": 4,
        "n_heads": 8,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": True,
        "use_kernels": True,
    },
    "optim": {
        "lr": 3e-3,
        "min_lr_ratio": 0.1,
        "warmup_steps": 20,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "grad_clip": 1.0,
    },
    "train": {
        "steps": 200,
        "micro_batch": 8,
        "grad_accum": 1,
        "seed": 1234,
        "log_every": 10,
        "eval_every": 50,
        "eval_batches": 8,
        "spike_factor": 3.0,
        "max_bad_steps": 3,
    },
    "checkpoint": {"every_steps": 50, "keep_last": 3, "resume": True},
    "generate": {
        "max_new_tokens": 200,
        "temperature": 0.8,
        "top_k": 50,
        "top_p": 0.95,
        "seed": 0,
    },
}

# Enum fields whose UNSPECIFIED value means a named default.
ENUM_DEFAULTS = {
    ("optim", "schedule"): "COSINE",
    ("train", "recompute"): "NONE",
}

# train.dtype spellings -> torch dtype names ("" = automatic, see train_dtype()).
DTYPES = {
    "": None,
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the field path."""


def ffn_dim_for(dim: int) -> int:
    """SwiGLU hidden width: 8/3 of dim (same parameters as a 4x GELU MLP), a multiple of 64."""
    hidden = -(-8 * dim // 3)
    return -(-hidden // 64) * 64


def resolve(cfg, kind: str = "PRETRAIN", world_size: int = 1):
    """A validated copy of `cfg` (a TrainerConfig) with every default applied.

    `kind` is the JobKind name; `world_size` the number of training processes.
    """
    out = type(cfg)()
    out.CopyFrom(cfg)
    out.data.CopyFrom(data_defaults.with_defaults(cfg.data))
    for section, fields in DEFAULTS.items():
        msg = getattr(out, section)
        for name, value in fields.items():
            if not msg.HasField(name):
                setattr(msg, name, value)
    for (section, name), value in ENUM_DEFAULTS.items():
        msg = getattr(out, section)
        if getattr(msg, name) == 0:
            setattr(msg, name, enum_value(msg, name, value))
    if out.train.parallelism == 0:
        several = "DDP" if world_size > 1 else "SINGLE"
        out.train.parallelism = enum_value(out.train, "parallelism", several)
    m = out.model
    if not m.HasField("n_kv_heads"):
        m.n_kv_heads = m.n_heads
    if not m.HasField("ffn_dim"):
        m.ffn_dim = ffn_dim_for(m.dim)
    if not m.HasField("max_seq_len"):
        m.max_seq_len = out.data.seq_len
    validate(out, kind)
    _check(
        world_size == 1 or enum_name(out.train, "parallelism") != "SINGLE",
        "train.parallelism",
        f"SINGLE with {world_size} processes would train {world_size} unrelated models: "
        "use DDP or FSDP",
    )
    return out


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"trainer.{field}: {problem}")


def validate(cfg, kind: str = "PRETRAIN") -> None:
    """Raise ConfigError for the first field of a resolved config that cannot work."""
    d, m, o, t, c, g = cfg.data, cfg.model, cfg.optim, cfg.train, cfg.checkpoint, cfg.generate
    try:
        data_defaults.validate(d)
    except DataConfigError as e:
        raise ConfigError(f"trainer.{e}") from e
    if kind == "SFT":
        _check(
            enum_name(d, "format") == "JSONL_CHAT",
            "data.format",
            f"SFT trains on prompt/response pairs: use JSONL_CHAT, not {enum_name(d, 'format')}",
        )

    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        value = getattr(m, name)
        _check(value > 0, f"model.{name}", f"{value} must be positive")
    _check(m.dim % m.n_heads == 0, "model.n_heads", f"{m.n_heads} does not divide dim {m.dim}")
    head_dim = m.dim // m.n_heads
    _check(
        head_dim % 2 == 0,
        "model.n_heads",
        f"{m.n_heads} heads give head_dim {head_dim}; rotary positions need an even head_dim",
    )
    _check(
        m.n_heads % m.n_kv_heads == 0,
        "model.n_kv_heads",
        f"{m.n_kv_heads} does not divide n_heads {m.n_heads}",
    )
    _check(
        d.seq_len <= m.max_seq_len,
        "data.seq_len",
        f"{d.seq_len} is longer than the model's positions (model.max_seq_len {m.max_seq_len})",
    )
    _check(m.rope_theta > 0, "model.rope_theta", f"{m.rope_theta:g} must be positive")
    _check(m.norm_eps > 0, "model.norm_eps", f"{m.norm_eps:g} must be positive")

    _check(o.lr > 0, "optim.lr", f"{o.lr:g} must be positive")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"{o.min_lr_ratio:g} not in [0, 1]")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", f"{o.warmup_steps} is negative")
    _check(o.weight_decay >= 0, "optim.weight_decay", f"{o.weight_decay:g} is negative")
    _check(0 <= o.beta1 < 1, "optim.beta1", f"{o.beta1:g} not in [0, 1)")
    _check(0 <= o.beta2 < 1, "optim.beta2", f"{o.beta2:g} not in [0, 1)")
    _check(o.grad_clip >= 0, "optim.grad_clip", f"{o.grad_clip:g} is negative (0 disables)")

    for name in ("steps", "micro_batch", "grad_accum", "log_every", "eval_batches"):
        value = getattr(t, name)
        _check(value > 0, f"train.{name}", f"{value} must be positive")
    _check(t.eval_every >= 0, "train.eval_every", f"{t.eval_every} is negative (0 disables)")
    _check(
        t.dtype.lower() in DTYPES,
        "train.dtype",
        f"{t.dtype!r} is not one of fp32, bf16 (or empty for automatic)",
    )
    _check(
        t.spike_factor > 1,
        "train.spike_factor",
        f"{t.spike_factor:g} must exceed 1 (a spike is this many times the recent median loss)",
    )
    _check(t.max_bad_steps >= 1, "train.max_bad_steps", f"{t.max_bad_steps} must be at least 1")

    _check(c.every_steps >= 0, "checkpoint.every_steps", f"{c.every_steps} is negative")
    _check(c.keep_last >= 1, "checkpoint.keep_last", f"{c.keep_last} must be at least 1")

    _check(g.max_new_tokens > 0, "generate.max_new_tokens", f"{g.max_new_tokens} must be positive")
    _check(g.temperature >= 0, "generate.temperature", f"{g.temperature:g} is negative")
    _check(g.top_k >= 0, "generate.top_k", f"{g.top_k} is negative (0 disables)")
    _check(0 < g.top_p <= 1, "generate.top_p", f"{g.top_p:g} not in (0, 1]")


def train_dtype(cfg, device):
    """The compute dtype: `train.dtype`, or bf16 on CUDA and fp32 elsewhere when it is empty."""
    import torch

    name = DTYPES[cfg.train.dtype.lower()]
    if name is None:
        name = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return getattr(torch, name)
