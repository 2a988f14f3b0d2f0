"""The defaults written in the protos are the defaults the code applies."""

import re
from pathlib import Path

import pytest

from protos import defaults, trainer_config_pb2
from protos.enums import enum_name

PROTO = Path(__file__).with_name("trainer_config.proto").read_text()
OPTIONAL = re.compile(r"^\s*optional (\w+) (\w+) = \d+;\s*//\s*default[: ]\s*(.*)$", re.M)
MESSAGE = re.compile(r"^message (\w+) \{(.*?)^\}", re.M | re.S)
UNSPECIFIED = re.compile(r"^\s*(\w+)_UNSPECIFIED = 0;\s*//\s*(\w+)", re.M)
SECTION_OF = {"DataConfig": "data", "ModelConfig": "model", "OptimConfig": "optim"}
SECTION_OF.update(TrainConfig="train", CheckpointConfig="checkpoint", GenerateConfig="generate")
SECTION_OF.update(HealthConfig="health")
SECTION_OF["RlConfig"] = "rl"
SECTION_OF.update(EvalConfig="eval")
SECTION_OF.update(VisionConfig="vision")  # #16
SECTION_OF.update(ServeConfig="serve")
SECTION_OF.update(DistillConfig="distill")  # #30
SECTION_OF.update(ProfileConfig="profile")  # #32


def _literal(type_name: str, text: str):
    """The value a `// default X ...` comment states, or None when it is not a literal."""
    token = text.split()[0].rstrip(",;:")
    if type_name == "bool":
        return {"true": True, "false": False}.get(token)
    if type_name == "string":
        match = re.match(r'"([^"]*)"', text)
        return match.group(1) if match else None
    try:
        return float(token) if type_name in ("float", "double") else int(token)
    except ValueError:
        return None


def _documented():
    for message, body in MESSAGE.findall(PROTO):
        for type_name, name, comment in OPTIONAL.findall(body):
            yield SECTION_OF[message], type_name, name, comment


def test_every_optional_field_has_a_documented_default():
    optional = {
        (SECTION_OF[m], f.name)
        for m, section in SECTION_OF.items()
        for f in getattr(trainer_config_pb2, m).DESCRIPTOR.fields
        if f.has_presence and f.message_type is None
    }
    documented = {(section, name) for section, _, name, _ in _documented()}
    assert optional == documented
    assert documented == {(s, n) for s, fields in defaults.SECTIONS.items() for n in fields}


@pytest.mark.parametrize("section, type_name, name, comment", list(_documented()))
def test_documented_default_is_the_applied_one(section, type_name, name, comment):
    field = defaults.SECTIONS[section][name]
    stated = _literal(type_name, comment)
    if field.default is None:  # DERIVED: the comment says from what, in words
        assert stated is None, f"{section}.{name}: documented {stated!r} but derived in code"
        return
    assert stated is not None, f"{section}.{name}: the comment {comment!r} states no value"
    if isinstance(stated, float):
        assert field.default == pytest.approx(stated), f"{section}.{name}"
    else:
        assert field.default == stated, f"{section}.{name}"
    applied = getattr(
        getattr(defaults.with_defaults(trainer_config_pb2.TrainerConfig()), section), name
    )
    assert applied == pytest.approx(stated) if isinstance(stated, float) else applied == stated


def test_unspecified_enum_values_document_their_default():
    documented = dict(UNSPECIFIED.findall(PROTO))
    for (section, name), value in defaults.ENUM_DEFAULTS.items():
        enum = getattr(trainer_config_pb2, section.title() + "Config").DESCRIPTOR
        enum_type = enum.fields_by_name[name].enum_type.name
        prefix = re.sub(r"(?<!^)([A-Z])", r"_\1", enum_type).upper()
        assert documented[prefix] == value, f"{section}.{name}"


def test_defaults_fill_every_field_and_derive_the_rest():
    cfg = defaults.with_defaults(trainer_config_pb2.TrainerConfig())
    for section in defaults.SECTIONS:
        msg = getattr(cfg, section)
        for field in msg.DESCRIPTOR.fields:
            if field.has_presence:
                assert msg.HasField(field.name), f"{section}.{field.name} has no default"
            if field.enum_type is not None:
                assert getattr(msg, field.name) != 0, f"{section}.{field.name} UNSPECIFIED"
    assert cfg.model.n_kv_heads == 8 and cfg.model.max_seq_len == cfg.data.seq_len == 256
    assert cfg.model.ffn_dim == 704  # 8/3 * 256 = 682.7, up to a multiple of 64
    assert cfg.data.workers >= 1
    assert enum_name(cfg.train, "parallelism") == "SINGLE"
    several = defaults.with_defaults(trainer_config_pb2.TrainerConfig(), world_size=2)
    assert enum_name(several.train, "parallelism") == "DDP"


def test_set_fields_and_explicit_zeros_are_kept_and_the_input_is_not_changed():
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.data.seq_len, cfg.data.eval_fraction = 128, 64, 0.0
    out = defaults.with_defaults(cfg)
    assert (out.model.dim, out.model.max_seq_len, out.data.eval_fraction) == (128, 64, 0.0)
    assert not cfg.model.HasField("n_layers")
