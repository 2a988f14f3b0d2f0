"""Is this job spec one that can run? One answer, for the launcher at submit and the trainer
at start. Every error is a ConfigError naming the field path: `trainer.model.n_heads: 6 does
not divide dim 256`.

The rules, in order:
1. The wire (`check_wire`): what a client can send that YAML cannot. Every enum holds a value
   its enum defines, every float is finite, strings and lists have a bounded length, and no
   field is unknown to this schema (proto3 keeps unknown fields and would echo them back).
2. The job (`validate_job_spec`): name and team are labels; kind is set; resources, retry
   and hang timeout lie in their ranges (RANGES below).
3. The trainer (`resolve_trainer`): the config with defaults applied (protos/defaults.py),
   every field in its range, and the rules that tie fields together (heads divide the width,
   SFT reads chat data, SINGLE runs one process, ...).
   The layout rules are in protos/validation_layout.py, the rules of particular job kinds
   (RLHF, VLM, serve) in protos/validation_kinds.py; protos/rules.py has the primitives.
What depends on this launcher (pools, quotas, images) is launcher/validation.py's; what
depends on files (does data.input exist?) is the trainer's, when it reads them.
"""

import math
import re

from google.protobuf import descriptor, unknown_fields
from google.protobuf.message import Message

from protos import defaults, enums, job_pb2, trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.defaults import Field
from protos.rules import check, check_range, check_ranges
from protos.validation_kinds import (
    IMAGE_FORMATS,
    RL_KINDS,
    TRAINING_KINDS,
    validate_distill,
    validate_rl,
    validate_serve,
    validate_vision,
)
from protos.validation_layout import validate_fp8, validate_layout, validate_moe

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)  # fullmatch: no "a\n"
NAME_RULE = "use letters, digits, '.', '_', '-' (at most 63, starting with a letter or digit)"
MAX_STRING = 4096  # bytes of any string field but the prompt: paths, image references
MAX_PROMPT = 1 << 16
MAX_LIST = 1024
DAY = 86400.0

# JobSpec fields outside the trainer: their ranges (0 means "the launcher's default" where
# the proto says so).
RANGES: dict[str, Field] = {
    "priority": Field(0, -1000, 1000),
    "resources.nodes": Field(0, 0, 4096),
    "resources.gpus_per_node": Field(0, 0, 64),
    "resources.processes_per_node": Field(0, 0, 1024),
    "retry.max_attempts": Field(0, 0, 100),
    "retry.backoff_seconds": Field(0, 0, DAY),
    "retry.max_backoff_seconds": Field(0, 0, 7 * DAY),
    "hang_timeout_seconds": Field(0, 0, 30 * DAY),
}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_wire(message: Message, path: str = "") -> None:
    """Rule 1 over `message` and everything in it."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = ", ".join(str(unknown[i].field_number) for i in range(len(unknown)))
        raise ConfigError(
            path or "(top level)",
            f"unknown field number(s) {numbers} for {message.DESCRIPTOR.full_name}: "
            "this launcher's schema does not have them (a newer client?)",
        )
    for field, value in message.ListFields():
        where = _join(path, field.name)
        if field.is_repeated:
            if len(value) > MAX_LIST:
                raise ConfigError(where, f"{len(value)} entries; at most {MAX_LIST}")
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(where, value)]
        for item_path, item in items:
            _check_value(message, field, item, item_path)


def _check_value(message, field, value, path):
    kind = field.type
    if kind == descriptor.FieldDescriptor.TYPE_MESSAGE:
        check_wire(value, path)
    elif kind == descriptor.FieldDescriptor.TYPE_ENUM:
        enums.check_member(message, field.name, path)
    elif kind in (descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE):
        if not math.isfinite(value):
            raise ConfigError(path, f"{value} is not a finite number")
    elif kind == descriptor.FieldDescriptor.TYPE_STRING:
        limit = MAX_PROMPT if path.endswith("generate.prompt") else MAX_STRING
        if len(value.encode("utf-8", "surrogatepass")) > limit:
            raise ConfigError(path, f"{len(value):,} characters; at most {limit:,} bytes")
        if "\x00" in value:
            raise ConfigError(path, "contains a NUL character")


def validate_job_spec(
    spec: job_pb2.JobSpec, world_size: int | None = None
) -> trainer_config_pb2.TrainerConfig:
    """Rules 1-3 for a whole spec; returns the trainer config the job will run with.

    `world_size`: the number of training processes, when known (the trainer under torchrun);
    else what `resources` asks for (nodes x processes_per_node)."""
    check_wire(spec)
    if not spec.name:
        raise ConfigError("name", "a job needs a name")
    if not NAME.fullmatch(spec.name):
        raise ConfigError("name", f"{spec.name[:80]!r}: {NAME_RULE}")
    for label in ("team", "owner"):
        value = getattr(spec, label)
        if value and not NAME.fullmatch(value):
            raise ConfigError(label, f"{value[:80]!r}: {NAME_RULE}")
    if spec.resources.pool and not NAME.fullmatch(spec.resources.pool):
        raise ConfigError("resources.pool", f"{spec.resources.pool[:80]!r}: {NAME_RULE}")
    if spec.kind == job_pb2.JOB_KIND_UNSPECIFIED:
        kinds = ", ".join(enums.choices(spec, "kind"))
        raise ConfigError("kind", f"a job needs a kind: one of {kinds}")
    for path, field in RANGES.items():
        message = spec
        *sections, name = path.split(".")
        for section in sections:
            message = getattr(message, section)
        check_range(getattr(message, name), field, path)
    if world_size is None:
        world_size = (spec.resources.nodes or 1) * (spec.resources.processes_per_node or 1)
    return _resolve(spec.trainer, spec.kind, world_size)  # the wire check above covered it


def resolve_trainer(
    cfg: trainer_config_pb2.TrainerConfig,
    kind: job_pb2.JobKind = job_pb2.PRETRAIN,
    world_size: int = 1,
) -> trainer_config_pb2.TrainerConfig:
    """Rule 3: a copy of `cfg` with every default applied, or a ConfigError."""
    check_wire(cfg, "trainer")
    return _resolve(cfg, kind, world_size)


def _resolve(cfg, kind, world_size) -> trainer_config_pb2.TrainerConfig:
    _setcheck_ranges(cfg)  # first: a derived default (ffn_dim from dim) must not overflow
    out = defaults.with_defaults(cfg, world_size)
    validate_trainer(out, kind, world_size)
    return out


def _setcheck_ranges(cfg: trainer_config_pb2.TrainerConfig) -> None:
    """The ranges of the fields a user set (the others take defaults, in range by design)."""
    for section, fields in defaults.SECTIONS.items():
        message = getattr(cfg, section)
        for name, field in fields.items():
            if message.HasField(name):
                check_range(getattr(message, name), field, f"trainer.{section}.{name}")


def resolve_data(data: trainer_config_pb2.DataConfig) -> trainer_config_pb2.DataConfig:
    """Rule 3 for a DataConfig on its own (precook run by hand); errors name `data.<field>`."""
    check_wire(data, "data")
    out = defaults.data_with_defaults(data)
    validate_data(out, "data")
    check(  # #16: images need the vision section (image size): a job through `train`
        out.format not in IMAGE_FORMATS,
        "data.format",
        f"{enums.enum_name(out, 'format')} holds images: precook it with a job (kind PRECOOK "
        "or VLM) run by `train`, which has the trainer.vision section",
    )
    return out


def validate_data(d: trainer_config_pb2.DataConfig, path: str = "trainer.data") -> None:
    """The rules of a defaulted DataConfig; errors name `<path>.<field>`."""
    check_ranges(d, "data", path)
    if d.tokenizer == trainer_config_pb2.BPE_TRAIN:
        check(
            d.vocab_size >= defaults.MIN_BPE_VOCAB,
            f"{path}.vocab_size",
            f"{d.vocab_size} cannot fit a byte-level BPE: it needs at least "
            f"{defaults.MIN_BPE_VOCAB} tokens ({defaults.BYTE_ALPHABET} bytes + "
            f"{len(defaults.SPECIAL_TOKENS)} special tokens)",
        )
    if d.tokenizer == trainer_config_pb2.BPE_FILE:
        check(bool(d.tokenizer_path), f"{path}.tokenizer_path", "is required for BPE_FILE")
    check(
        d.shard_tokens >= d.seq_len,
        f"{path}.shard_tokens",
        f"{d.shard_tokens} is smaller than one row (seq_len {d.seq_len})",
    )
    if d.format == trainer_config_pb2.JSONL:
        check(bool(d.text_field), f"{path}.text_field", "must name the JSON field of the text")
    if d.format == trainer_config_pb2.JSONL_CHAT:
        check(bool(d.prompt_field), f"{path}.prompt_field", "must name the JSON prompt field")
        check(bool(d.response_field), f"{path}.response_field", "must name the response field")
        check(
            d.prompt_field != d.response_field,
            f"{path}.response_field",
            f"is the same field as prompt_field ({d.prompt_field!r})",
        )
    _validate_curation(d, path)


def _validate_curation(d: trainer_config_pb2.DataConfig, path: str) -> None:
    """#21: the mixture's sources and the filters (trainer/data/mixture.py, filters.py)."""
    check(
        d.max_doc_tokens == 0 or d.max_doc_tokens >= d.min_doc_tokens,
        f"{path}.max_doc_tokens",
        f"{d.max_doc_tokens} is below min_doc_tokens ({d.min_doc_tokens}); 0 means no limit",
    )
    if not d.sources:
        return
    check(not d.input, f"{path}.input", "must be empty when sources are given")
    names: set[str] = set()
    chat = d.format == trainer_config_pb2.JSONL_CHAT
    for i, src in enumerate(d.sources):
        at = f"{path}.sources[{i}]"
        check(bool(NAME.fullmatch(src.name)), f"{at}.name", f"{src.name!r}: {NAME_RULE}")
        check(src.name not in names, f"{at}.name", f"{src.name!r} names two sources")
        names.add(src.name)
        check(bool(src.input), f"{at}.input", "is required")
        check(src.weight >= 0, f"{at}.weight", f"{src.weight} is negative")
        check(src.token_budget >= 0, f"{at}.token_budget", f"{src.token_budget} is negative")
        check(
            not (src.weight and src.token_budget),
            f"{at}.token_budget",
            "give a weight or a token budget, not both",
        )
        fmt = src.format or d.format
        check(
            (fmt == trainer_config_pb2.JSONL_CHAT) == chat,
            f"{at}.format",
            "JSONL_CHAT sources mix only with each other (data.format JSONL_CHAT)",
        )


def validate_trainer(
    cfg: trainer_config_pb2.TrainerConfig,
    kind: job_pb2.JobKind = job_pb2.PRETRAIN,
    world_size: int = 1,
) -> None:
    """The rules of a defaulted TrainerConfig (see the module docstring, rule 3)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    validate_data(d)
    check(  # with_defaults derives head_dim only where n_heads divides dim (before
        # the ranges: an underived head_dim is 0)
        m.HasField("head_dim"),
        "trainer.model.n_heads",
        f"{m.n_heads} does not divide dim {m.dim} (or set model.head_dim)",
    )
    for section in ("model", "optim", "train", "checkpoint", "generate"):
        check_ranges(getattr(cfg, section), section, f"trainer.{section}")
    check_ranges(cfg.health, "health", "trainer.health")
    check_ranges(cfg.eval, "eval", "trainer.eval")
    validate_profile(cfg, kind)  # #32
    if kind == job_pb2.IMPORT:
        check(bool(cfg.hf.path), "trainer.hf.path", "IMPORT reads a Hugging Face model directory")
    check(
        cfg.hf.dtype.lower() in defaults.EXPORT_DTYPES,
        "trainer.hf.dtype",
        f"{cfg.hf.dtype!r} is not one of fp32, bf16, fp16 (or empty: the checkpoint's own)",
    )
    validate_vision(cfg, kind)  # #16
    check(  # #21: a PRECOOK job's tasks are the launcher's (launcher/executors/task_array.py)
        d.tasks == 1 or (kind == job_pb2.PRECOOK and d.format not in IMAGE_FORMATS),
        "trainer.data.tasks",
        f"{d.tasks} tasks: only a PRECOOK job of text runs as tasks (others precook in one)",
    )
    if kind == job_pb2.SFT:
        check(
            d.format == trainer_config_pb2.JSONL_CHAT,
            "trainer.data.format",
            "SFT trains on prompt/response pairs: use JSONL_CHAT, not "
            + enums.enum_name(d, "format"),
        )
    if kind in RL_KINDS:
        validate_rl(cfg, kind)
    if kind == job_pb2.DISTILL:
        validate_distill(cfg)
    check(
        m.head_dim % 2 == 0,
        "trainer.model.head_dim",
        f"{m.head_dim} (n_heads {m.n_heads} on dim {m.dim}): rotary positions need it even",
    )
    check(
        m.n_heads % m.n_kv_heads == 0,
        "trainer.model.n_kv_heads",
        f"{m.n_kv_heads} does not divide n_heads {m.n_heads}",
    )
    check(
        d.seq_len <= m.max_seq_len,
        "trainer.data.seq_len",
        f"{d.seq_len} is longer than the model's positions (model.max_seq_len {m.max_seq_len})",
    )
    check(
        t.dtype.lower() in defaults.DTYPES,
        "trainer.train.dtype",
        f"{t.dtype!r} is not one of fp32, bf16, fp16, fp8 (or empty for automatic)",
    )
    validate_fp8(cfg)
    check(
        not (
            defaults.DTYPES.get(t.dtype.lower()) == "float16"
            and t.parallelism == trainer_config_pb2.FSDP
        ),
        "trainer.train.dtype",
        "fp16 with FSDP is not supported (its loss scaling would need a sharded scaler): use bf16",
    )
    check(
        world_size == 1 or t.parallelism != trainer_config_pb2.SINGLE,
        "trainer.train.parallelism",
        f"SINGLE with {world_size} processes would train {world_size} unrelated models: "
        "use DDP or FSDP",
    )
    if kind == job_pb2.SERVE:
        validate_serve(cfg)
    validate_moe(cfg, world_size)
    validate_layout(cfg, world_size)


def validate_profile(cfg: trainer_config_pb2.TrainerConfig, kind: job_pb2.JobKind) -> None:
    """#32: the profiled steps are training steps this job takes."""
    p = cfg.profile
    check_ranges(p, "profile", "trainer.profile")
    if not p.steps:
        return
    check(
        kind in TRAINING_KINDS,
        "trainer.profile.steps",
        f"profiles training steps, and {job_pb2.JobKind.Name(kind)} jobs take none",
    )
    last = p.start_step + p.steps - 1
    check(
        last <= cfg.train.steps,
        "trainer.profile.start_step",
        f"steps {p.start_step}..{last} end past the job's last step (train.steps "
        f"{cfg.train.steps})",
    )
