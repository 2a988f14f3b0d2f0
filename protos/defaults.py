"""TrainerConfig's defaults and ranges: one table, applied once, by both sides.

Each optional field of protos/trainer_config.proto has a `Field` here: the default written
beside it in the proto (`// default X`; defaults_test parses every such comment and compares)
and the range a value must lie in. `with_defaults(cfg, world_size)` fills every unset
field; protos/validation.py checks the ranges and the rules that tie fields together. The
launcher runs both at submit and the trainer again at start, so a job the launcher accepts
is one the trainer accepts.

Defaults that depend on other fields or on the machine are DERIVED, computed in
`with_defaults`: n_kv_heads (= n_heads), ffn_dim (8/3 dim), head_dim (dim / n_heads),
max_seq_len (= data.seq_len), workers (the CPUs this process may use), parallelism (SINGLE,
or DDP with several processes), rl.pass_verifier (= rl.reward),
pipeline_virtual_stages (2 for the interleaved schedule, else 1).
"""

import dataclasses
import math
import os

from protos import trainer_config_pb2

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Field:
    """A field's default (None: DERIVED) and its closed range [low, high] (open at an end
    where low_open / high_open)."""

    default: int | float | bool | str | None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value) -> str | None:
        """Why `value` is out of range, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value} is not a finite number"
        if self.low is None and self.high is None:
            return None
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if below or above:
            return f"{_number(value)} is not in {self.range_text()}"
        return None

    def range_text(self) -> str:
        low = "(" if self.low_open else "["
        high = ")" if self.high_open else "]"
        return f"{low}{_number(self.low)}, {_number(self.high)}{high}"


def _number(value) -> str:
    """2,147,483,647 for an int, 1e-05 for a float: readable in an error message."""
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


# section of TrainerConfig -> {field: Field}. Ranges are what can work at all, generously:
# the bounds stop a typo (or a hostile spec) from asking for 2^31 layers, not a big model.
SECTIONS: dict[str, dict[str, Field]] = {
    "data": {
        "text_field": Field("text"),
        "prompt_field": Field("prompt"),
        "response_field": Field("response"),
        "vocab_size": Field(4096, 1, 1 << 24),  # BPE_TRAIN also needs MIN_BPE_VOCAB
        "seq_len": Field(256, 2, 1 << 20),
        "shard_tokens": Field(16 * 1024 * 1024, 2, 1 << 40),
        "workers": Field(None, 1, 1024),
        "eval_fraction": Field(0.02, 0, 1, high_open=True),
        "max_documents": Field(0, 0, INT32_MAX),
        "mixture_seed": Field(1234, 0, INT64_MAX),
        "dedup_exact": Field(False),
        "near_dup_threshold": Field(0.0, 0, 1),
        "min_doc_tokens": Field(0, 0, INT32_MAX),
        "max_doc_tokens": Field(0, 0, INT32_MAX),
        "min_alpha_fraction": Field(0.0, 0, 1),
        "max_repeated_line_fraction": Field(1.0, 0, 1),
        "tasks": Field(1, 1, 1 << 16),
    },
    "model": {
        "dim": Field(256, 2, 1 << 16),
        "n_layers": Field(4, 1, 1024),
        "n_heads": Field(8, 1, 1024),
        "n_kv_heads": Field(None, 1, 1024),
        "ffn_dim": Field(None, 1, 1 << 20),
        "head_dim": Field(None, 2, 1 << 16),
        "max_seq_len": Field(None, 2, 1 << 20),
        "rope_theta": Field(10000.0, 0, 1e12, low_open=True),
        "norm_eps": Field(1e-5, 0, 1, low_open=True),
        "tie_embeddings": Field(True),
        "use_kernels": Field(True),
        "moe_experts": Field(0, 0, 1 << 16),
        "moe_top_k": Field(2, 1, 1 << 16),
        "moe_shared_experts": Field(0, 0, 64),
        "moe_every": Field(1, 1, 1024),
        "moe_ffn_dim": Field(None, 1, 1 << 20),
        "moe_aux_loss_coef": Field(0.01, 0, 100),
        "moe_z_loss_coef": Field(0.001, 0, 100),
        "moe_capacity_factor": Field(0.0, 0, 1024),
        "moe_bias_update_rate": Field(0.001, 0, 1),
        "moe_first_dense": Field(0, 0, 1024),
    },
    "optim": {
        "lr": Field(3e-3, 0, 10, low_open=True),
        "min_lr_ratio": Field(0.1, 0, 1),
        "warmup_steps": Field(20, 0, INT32_MAX),
        "weight_decay": Field(0.1, 0, 10),
        "beta1": Field(0.9, 0, 1, high_open=True),
        "beta2": Field(0.95, 0, 1, high_open=True),
        "grad_clip": Field(1.0, 0, 1e6),
    },
    "train": {
        "steps": Field(200, 1, 1 << 30),
        "micro_batch": Field(8, 1, 1 << 16),
        "grad_accum": Field(1, 1, 1 << 16),
        "seed": Field(1234, 0, INT64_MAX),
        "log_every": Field(10, 1, 1 << 30),
        "eval_every": Field(50, 0, 1 << 30),
        "eval_batches": Field(8, 1, 1 << 20),
        "spike_factor": Field(3.0, 1, 1e6, low_open=True),
        "max_bad_steps": Field(3, 1, 1000),
        "expert_parallel": Field(0, 0, 1 << 16),
        "tensor_parallel": Field(1, 1, 1024),
        "sequence_parallel": Field(False),
        "pipeline_parallel": Field(1, 1, 1024),
        "pipeline_virtual_stages": Field(None, 1, 64),
        "context_parallel": Field(1, 1, 1024),
    },
    "checkpoint": {
        "every_steps": Field(50, 0, 1 << 30),
        "keep_last": Field(3, 1, 1000),
        "resume": Field(True),
    },
    "generate": {
        "max_new_tokens": Field(200, 1, 1 << 20),
        "temperature": Field(0.8, 0, 100),
        "top_k": Field(50, 0, 1 << 24),
        "top_p": Field(0.95, 0, 1, low_open=True),
        "seed": Field(0, 0, INT64_MAX),
    },
    "health": {
        "sdc_check_every": Field(50, 0, 1 << 30),
        "hang_timeout_seconds": Field(600.0, 0, 1e6),
        "straggler_factor": Field(1.5, 1, 1e6, low_open=True),
        "replay_check_every": Field(0, 0, 1 << 30),
    },
    "rl": {  # #14: REWARD, DPO, PPO (trainer/rl/)
        "beta": Field(0.1, 0, 100, low_open=True),
        "label_smoothing": Field(0.0, 0, 0.5, high_open=True),
        "kl_coef": Field(0.05, 0, 100),
        "group_size": Field(4, 1, 1024),
        "rollout_prompts": Field(8, 1, 1 << 16),
        "ppo_epochs": Field(2, 1, 100),
        "clip_range": Field(0.2, 0, 10, low_open=True),
        "value_clip": Field(0.2, 0, 1e6, low_open=True),
        "gamma": Field(1.0, 0, 1),
        "gae_lambda": Field(0.95, 0, 1),
        "value_coef": Field(0.5, 0, 100),
        "max_new_tokens": Field(24, 1, 1 << 16),
        "temperature": Field(1.0, 0, 100, low_open=True),
        "eval_fraction": Field(0.1, 0, 1, high_open=True),
    },
    "profile": {  # #32: a profile of a few training steps (trainer/step_profiler.py)
        "steps": Field(0, 0, 1000),
        "start_step": Field(5, 1, 1 << 30),
        "top_ops": Field(15, 1, 1000),
    },
    "distill": {  # #30: DISTILL (trainer/recipes/distill.py)
        "temperature": Field(1.0, 0, 100, low_open=True),
        "alpha": Field(0.5, 0, 1),
    },
    "eval": {
        "limit": Field(0, 0, INT32_MAX),
        "batch_size": Field(8, 1, 1 << 16),
    },
    "vision": {  # #16 VLM
        "image_size": Field(32, 4, 1024),
        "patch_size": Field(4, 1, 256),
        "dim": Field(128, 2, 1 << 16),
        "n_layers": Field(2, 1, 1024),
        "n_heads": Field(4, 1, 1024),
        "pixel_shuffle": Field(2, 1, 16),
        "train_encoder": Field(True),
        "image_field": Field("image"),
        "type_field": Field("type"),
    },
    "serve": {
        "port": Field(0, 0, 65535),
        "block_size": Field(16, 1, 1 << 16),
        "num_blocks": Field(512, 1, 1 << 24),
        "max_batch_tokens": Field(512, 1, 1 << 24),
        "max_running": Field(64, 1, 1 << 16),
        "max_waiting": Field(256, 0, 1 << 20),
        "heartbeat_seconds": Field(5.0, 0, 3600, low_open=True),
        "max_body_bytes": Field(2 << 20, 1024, 1 << 30),
        "max_prompt_chars": Field(65536, 1, 1 << 28),
        "max_stop": Field(4, 0, 1024),
        "max_stop_chars": Field(256, 1, 1 << 16),
        "request_timeout_seconds": Field(30.0, 0, 3600, low_open=True),
        "idle_timeout_seconds": Field(5.0, 0, 3600, low_open=True),
        "prefix_caching": Field(True),
        "chunked_prefill": Field(True),
        "speculative_tokens": Field(0, 0, 64),
    },
}

# Enum fields whose UNSPECIFIED value means a named default (written beside the UNSPECIFIED
# value in the proto). train.parallelism is DERIVED from the number of processes.
ENUM_DEFAULTS: dict[tuple[str, str], str] = {
    ("data", "format"): "TEXT_FILES",
    ("data", "tokenizer"): "BPE_TRAIN",
    ("data", "packing"): "BEST_FIT",
    ("optim", "schedule"): "COSINE",
    ("train", "recompute"): "NONE",
    ("rl", "reward"): "REWARD_MODEL",
    ("rl", "dpo_loss"): "SIGMOID_LOSS",
    ("rl", "algorithm"): "CLIPPED_PPO",
    ("model", "moe_gate"): "SOFTMAX",
    ("model", "moe_balance"): "AUX_LOSS",
    ("vision", "stage"): "ALIGN",
    ("vision", "bad_images"): "SKIP_BAD",
    ("train", "pipeline_schedule"): "ONE_F_ONE_B",
}

# train.dtype spellings -> torch dtype names ("" = automatic: bf16 on CUDA, fp32 elsewhere).
DTYPES: dict[str, str | None] = {
    "": None,
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",  # with dynamic loss scaling (trainer/model_setup.py)
    "float16": "float16",
    # #20: fp8 linears (trainer/fp8.py) inside bf16 autocast: bf16 is the compute dtype.
    "fp8": "bfloat16",
    "float8": "bfloat16",
}
# hf.dtype spellings: an export's weights are stored, not computed with ("" = as saved).
EXPORT_DTYPES = frozenset(DTYPES) - {"fp8", "float8"}
# train.dtype spellings that swap the blocks' Linear layers for float8 ones (CUDA 8.9+ only).
FP8_DTYPES = frozenset({"fp8", "float8"})

# A byte-level BPE starts from 256 byte tokens plus <|bos|>, <|eos|>, <|pad|>.
BYTE_ALPHABET = 256
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
MIN_BPE_VOCAB = BYTE_ALPHABET + len(SPECIAL_TOKENS)


def ffn_dim_for(dim: int) -> int:
    """SwiGLU hidden width: 8/3 of dim (same parameters as a 4x GELU MLP), a multiple of 64."""
    hidden = -(-8 * dim // 3)
    return -(-hidden // 64) * 64


def head_dim(m: trainer_config_pb2.ModelConfig) -> int:
    """One attention head's width: model.head_dim, or dim / n_heads where it is 0 (a checkpoint
    saved before the field existed; with_defaults fills it for every new config)."""
    return m.head_dim or m.dim // m.n_heads


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _fill(message, section: str) -> None:
    for name, field in SECTIONS[section].items():
        if field.default is not None and not message.HasField(name):
            setattr(message, name, field.default)
    for (sec, name), value in ENUM_DEFAULTS.items():
        if sec == section and getattr(message, name) == 0:
            setattr(message, name, getattr(trainer_config_pb2, value))


def data_with_defaults(
    data: trainer_config_pb2.DataConfig,
) -> trainer_config_pb2.DataConfig:
    """A copy of a DataConfig with every default applied (precook run on its own)."""
    out = trainer_config_pb2.DataConfig()
    out.CopyFrom(data)
    _fill(out, "data")
    if not out.HasField("workers"):
        out.workers = default_workers()
    return out


def with_defaults(
    cfg: trainer_config_pb2.TrainerConfig, world_size: int = 1
) -> trainer_config_pb2.TrainerConfig:
    """A copy of `cfg` with every unset field set; `cfg` is not changed. `world_size` (the
    number of training processes) decides the default parallelism."""
    out = trainer_config_pb2.TrainerConfig()
    out.CopyFrom(cfg)
    out.data.CopyFrom(data_with_defaults(cfg.data))
    for section in SECTIONS:
        if section != "data":
            _fill(getattr(out, section), section)
    if out.train.parallelism == trainer_config_pb2.PARALLELISM_UNSPECIFIED:
        several = world_size > 1
        out.train.parallelism = trainer_config_pb2.DDP if several else trainer_config_pb2.SINGLE
    if out.rl.pass_verifier == trainer_config_pb2.REWARD_SOURCE_UNSPECIFIED:  # #14
        out.rl.pass_verifier = out.rl.reward
    if not out.train.HasField("pipeline_virtual_stages"):
        interleaved = out.train.pipeline_schedule == trainer_config_pb2.INTERLEAVED_1F1B
        out.train.pipeline_virtual_stages = 2 if interleaved else 1
    m = out.model
    if not m.HasField("n_kv_heads"):
        m.n_kv_heads = m.n_heads
    if not m.HasField("ffn_dim"):
        m.ffn_dim = ffn_dim_for(m.dim)
    if not m.HasField("head_dim") and m.dim % m.n_heads == 0:  # else validation names n_heads
        m.head_dim = m.dim // m.n_heads
    if not m.HasField("max_seq_len"):
        m.max_seq_len = out.data.seq_len
    if not m.HasField("moe_ffn_dim"):
        m.moe_ffn_dim = m.ffn_dim
    return out
