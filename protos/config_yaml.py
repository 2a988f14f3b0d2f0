"""YAML config files onto proto messages: keys are the proto field names, one to one.

`load_job_spec("configs/tiny.yaml")` gives a `kitchen.v1.JobSpec`. Enum values are written by
name (any case). Anything the schema does not know or cannot hold is a `ConfigError` that names
the file and the field path, e.g. `job.yaml: trainer.model.n_heads: expected int, got 'x'`.
The same mapping reads the launcher's own config (`load_message(path, LauncherConfig())`).
"""

import difflib
import os
import re

import yaml
from google.protobuf import descriptor

from protos import job_pb2

_INT_TYPES = {
    descriptor.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    descriptor.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    descriptor.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    descriptor.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_TYPES = {descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE}


class ConfigError(ValueError):
    """A config value the schema rejects. `field` is the dotted path, `source` the file."""

    def __init__(self, field: str, problem: str, source: str | None = None):
        self.field = field
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field or '(top level)'}: {problem}")


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads `3e-4` as a float (YAML 1.2 style;
    YAML 1.1 would make it a string, a classic surprise in learning-rate fields)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(str(key), f"duplicate key (line {line})")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _scalar(field: descriptor.FieldDescriptor, value, path: str):
    """The Python value a proto scalar field holds, or a ConfigError naming the path."""
    if field.type in _INT_TYPES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int, got {value!r}")
        low, high = _INT_TYPES[field.type]
        if not low <= value <= high:
            raise ConfigError(path, f"{value} is out of range [{low}, {high}]")
        return value
    if field.type in _FLOAT_TYPES:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if field.type == descriptor.FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if field.type == descriptor.FieldDescriptor.TYPE_STRING:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r} (quote it)")
        return value
    enum = field.enum_type  # set on every enum field
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM and enum is not None:
        names = [v.name for v in enum.values if not v.name.endswith("_UNSPECIFIED")]
        if isinstance(value, str):
            for v in enum.values:
                if v.name.lower() == value.lower():
                    return v.number
        raise ConfigError(path, f"expected one of {', '.join(names)}, got {value!r}")
    raise ConfigError(path, f"field type {field.type} cannot be set from YAML")


def fill_message(message, data, source: str | None = None, path: str = ""):
    """Sets `message`'s fields from a dict of proto field names; returns the message."""
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping of fields, got {data!r}", source)
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in data.items():
        key_path = _join(path, str(key))
        field = fields.get(key) if isinstance(key, str) else None
        if field is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            known = ", ".join(fields)
            raise ConfigError(key_path, f"unknown field{hint}; known fields: {known}", source)
        if value is None:  # `key:` with nothing after it leaves the field unset
            continue
        try:
            _set_field(message, field, value, key_path, source)
        except ConfigError as e:
            if e.source is None:
                raise ConfigError(e.field, e.problem, source) from None
            raise
    return message


def _set_field(message, field, value, path, source):
    is_message = field.type == descriptor.FieldDescriptor.TYPE_MESSAGE
    if field.is_repeated:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {value!r}")
        container = getattr(message, field.name)
        for i, item in enumerate(value):
            item_path = f"{path}[{i}]"
            if is_message:
                fill_message(container.add(), item, source, item_path)
            else:
                container.append(_scalar(field, item, item_path))
    elif is_message:
        sub = getattr(message, field.name)
        fill_message(sub, value, source, path)
        sub.SetInParent()  # `model: {}` still marks the section as given
    else:
        setattr(message, field.name, _scalar(field, value, path))


def load_yaml(path: str):
    """The YAML document in `path`, or a ConfigError naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except OSError as e:
        raise ConfigError("", f"cannot read config: {e.strerror}", path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            "", f"not a UTF-8 text file (byte {e.start}): a YAML config?", path
        ) from None
    except ConfigError as e:
        raise ConfigError(e.field, e.problem, path) from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"not valid YAML: {e}", path) from None


def load_message(path: str, message):
    """Fills `message` (any proto message) from the YAML file at `path`."""
    data = load_yaml(path)
    return fill_message(message, {} if data is None else data, source=path)


def job_spec_from_dict(d, source: str | None = None) -> job_pb2.JobSpec:
    """A JobSpec from a dict shaped like the YAML config (keys are proto field names)."""
    return fill_message(job_pb2.JobSpec(), d, source=source)


def load_job_spec(path: str) -> job_pb2.JobSpec:
    """The JobSpec in the YAML file at `path`; a job without a `name:` is named after the
    file (`configs/tiny.yaml` -> `tiny`)."""
    data = load_yaml(path)
    if data is None:
        raise ConfigError("", "the file is empty; a job needs at least `kind:`", path)
    spec = job_spec_from_dict(data, source=path)
    spec.name = spec.name or os.path.splitext(os.path.basename(path))[0]
    return spec
