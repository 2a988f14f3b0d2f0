"""Kitchen's Transformer is Hugging Face's `LlamaForCausalLM`: the same architecture (RMSNorm,
rotate-half rotary positions, SwiGLU, grouped-query attention, no biases) under other names.
This module is the one table between the two: tensor names and config.json fields. Torch-free.

No tensor is permuted: Kitchen's rotary embedding already rotates halves, as Llama's does
(torchtitan's conversion scripts permute wq/wk because Meta's original checkpoints rotate
interleaved pairs; a Kitchen checkpoint never did).
"""

import dataclasses

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.defaults import head_dim

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# Kitchen name -> HF name, per block (`layers.{i}.` / `model.layers.{i}.` prefixes).
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class HfFormatError(ConfigError):
    """What Kitchen cannot export or import: `field` is the config.json field, the tensor or
    the job config field at fault, `source` the file. A bad input: the trainer exits 2."""


def hf_name(name: str) -> str:
    """The HF tensor name of Kitchen parameter `name`."""
    if name in _TOP:
        return _TOP[name]
    prefix, layer, rest = name.split(".", 2)
    if prefix != "layers" or rest not in _BLOCK:
        raise KeyError(f"{name}: not a parameter of Kitchen's Transformer")
    return f"model.layers.{layer}.{_BLOCK[rest]}"


def expected_shapes(m: trainer_config_pb2.ModelConfig, vocab: int) -> dict[str, tuple]:
    """HF tensor name -> shape, and the config.json field each dimension comes from, for a
    model of ModelConfig `m` (resolved). lm_head only when the embeddings are not tied."""
    head = head_dim(m)
    block = {
        "self_attn.q_proj.weight": (m.n_heads * head, m.dim),
        "self_attn.k_proj.weight": (m.n_kv_heads * head, m.dim),
        "self_attn.v_proj.weight": (m.n_kv_heads * head, m.dim),
        "self_attn.o_proj.weight": (m.dim, m.n_heads * head),
        "mlp.gate_proj.weight": (m.ffn_dim, m.dim),
        "mlp.up_proj.weight": (m.ffn_dim, m.dim),
        "mlp.down_proj.weight": (m.dim, m.ffn_dim),
        "input_layernorm.weight": (m.dim,),
        "post_attention_layernorm.weight": (m.dim,),
    }
    out = {"model.embed_tokens.weight": (vocab, m.dim), "model.norm.weight": (m.dim,)}
    for i in range(m.n_layers):
        out.update({f"model.layers.{i}.{k}": v for k, v in block.items()})
    if not m.tie_embeddings:
        out["lm_head.weight"] = (vocab, m.dim)
    return out


# Which config.json field decides each kind of dimension (for error messages).
SHAPE_FIELDS = {
    "q_proj": "num_attention_heads, head_dim, hidden_size",
    "k_proj": "num_key_value_heads, head_dim, hidden_size",
    "v_proj": "num_key_value_heads, head_dim, hidden_size",
    "o_proj": "hidden_size, num_attention_heads, head_dim",
    "gate_proj": "intermediate_size, hidden_size",
    "up_proj": "intermediate_size, hidden_size",
    "down_proj": "hidden_size, intermediate_size",
    "embed_tokens": "vocab_size, hidden_size",
    "lm_head": "vocab_size, hidden_size",
}


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    bos_id: int
    eos_id: int
    pad_id: int


def hf_config(
    m: trainer_config_pb2.ModelConfig, vocab: int, special: SpecialTokens, dtype: str
) -> dict:
    """config.json of a LlamaForCausalLM equal to Kitchen's model of ModelConfig `m`.

    The rotary base is written both ways transformers has read it: `rope_parameters`
    (transformers 5) and `rope_theta` (4.x)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab,
        "hidden_size": m.dim,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": head_dim(m),
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": _decimal(m.norm_eps),
        "rope_theta": _decimal(m.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": _decimal(m.rope_theta)},
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special.bos_id,
        "eos_token_id": special.eos_id,
        "pad_token_id": special.pad_id,
        "dtype": dtype,
        "use_cache": True,
    }


def _decimal(value: float) -> float:
    """A proto float (fp32) as the decimal it was written as: 1e-05, not 9.99999974738e-06."""
    return float(f"{value:.7g}")


def _field(config: dict, name: str, kind: type, source: str, default=None):
    value = config.get(name, default)
    if value is None:
        raise HfFormatError(name, "missing", source)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HfFormatError(name, f"{value!r} is not {kind.__name__}", source)
    return value


def _refuse_unless(ok: bool, source: str, name: str, problem: str) -> None:
    if not ok:
        raise HfFormatError(name, problem, source)


def _rope_theta(config: dict, source: str) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise HfFormatError("rope_parameters", "not a JSON object", source)
    for name, section in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = section.get("rope_type", section.get("type", "default"))
        _refuse_unless(
            kind == "default",
            source,
            f"{name}.rope_type",
            f"{kind!r}: Kitchen's rotary embedding has no scaling (only 'default')",
        )
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(_field({"rope_theta": theta}, "rope_theta", float, source))


def model_config(config: dict, source: str) -> tuple[trainer_config_pb2.ModelConfig, int]:
    """(ModelConfig, vocab size) of a config.json, or HfFormatError naming the field Kitchen's
    model cannot represent."""
    kind = config.get("model_type")
    architectures = config.get("architectures") or [ARCHITECTURE]
    _refuse_unless(
        kind == MODEL_TYPE,
        source,
        "model_type",
        f"{kind!r}: only the Llama architecture ({MODEL_TYPE!r}) maps onto Kitchen's model",
    )
    _refuse_unless(
        ARCHITECTURE in architectures,
        source,
        "architectures",
        f"{architectures}: expected {ARCHITECTURE}",
    )
    dim = _field(config, "hidden_size", int, source)
    heads = _field(config, "num_attention_heads", int, source)
    kv_heads = _field(config, "num_key_value_heads", int, source, heads)
    _refuse_unless(heads > 0, source, "num_attention_heads", f"{heads} must be positive")
    width = config.get("head_dim") or (dim // heads if dim % heads == 0 else 0)
    _refuse_unless(width > 0, source, "num_attention_heads",
                   f"{heads} does not divide hidden_size {dim}, nor is head_dim given")  # fmt: skip
    _refuse_unless(width % 2 == 0, source, "head_dim", f"{width}: rotary needs even")
    _refuse_unless(kv_heads > 0 and heads % kv_heads == 0, source, "num_key_value_heads",
                   f"{kv_heads} does not divide num_attention_heads {heads}")  # fmt: skip
    act = config.get("hidden_act", "silu")
    _refuse_unless(act == "silu", source, "hidden_act", f"{act!r}: Kitchen's MLP is SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        _refuse_unless(not config.get(flag), source, flag, "true: Kitchen's layers have no bias")
    m = trainer_config_pb2.ModelConfig(
        dim=dim,
        n_layers=_field(config, "num_hidden_layers", int, source),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=width,
        ffn_dim=_field(config, "intermediate_size", int, source),
        max_seq_len=_field(config, "max_position_embeddings", int, source, 2048),
        rope_theta=_rope_theta(config, source),
        norm_eps=_field(config, "rms_norm_eps", float, source, 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    return m, _field(config, "vocab_size", int, source)
