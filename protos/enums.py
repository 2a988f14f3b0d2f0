"""Proto enum values by name, and the check that a value is a member at all.

proto3 enums are open: a client speaking raw gRPC can send `kind: 99`, and Python keeps it as
a plain int. `check_member` is what turns that into an error naming the field.
"""

from google.protobuf.message import Message

from protos.config_yaml import ConfigError


def _enum(message: Message, field: str):
    return message.DESCRIPTOR.fields_by_name[field].enum_type


def choices(message: Message, field: str) -> list[str]:
    """The names a user may write for `field` (UNSPECIFIED is not a choice)."""
    return [v.name for v in _enum(message, field).values if not v.name.endswith("_UNSPECIFIED")]


def enum_name(message: Message, field: str) -> str:
    """The name of an enum field's value, e.g. enum_name(data, "packing") == "BEST_FIT"."""
    value = getattr(message, field)
    known = _enum(message, field).values_by_number.get(value)
    return known.name if known is not None else str(value)


def enum_value(message: Message, field: str, name: str, path: str = "") -> int:
    """The number of enum value `name` (any case) of `field`, or a ConfigError at `path`."""
    values = _enum(message, field).values_by_name
    key = name.upper()
    if key not in values or key.endswith("_UNSPECIFIED"):
        choice = ", ".join(choices(message, field))
        raise ConfigError(path or field, f"{name!r} is not one of {choice}")
    return values[key].number


def check_member(message: Message, field: str, path: str) -> None:
    """A ConfigError at `path` unless the enum field holds a value its enum defines."""
    value = getattr(message, field)
    if value not in _enum(message, field).values_by_number:
        raise ConfigError(
            path, f"{value} is not a value of {_enum(message, field).name}: use one of "
            + ", ".join(choices(message, field))
        )  # fmt: skip
