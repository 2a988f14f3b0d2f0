"""YAML config files onto proto messages: keys are the proto field names, one to one.

`load_job_spec("configs/tiny.yaml")` gives a `kitchen.v1.JobSpec`. Enum values are written by
name (any case). Anything the schema does not know or cannot hold is a `ConfigError` that names
the file and the field path, e.g. `job.yaml: trainer.model.n_heads: expected int, got 'x'`.
The same mapping reads the launcher's own config (`load_message(path, LauncherConfig())`).

A config may come from anyone, so reading one is bounded: only a regular file (a FIFO would
block forever), at most MAX_BYTES, parsed by libyaml (the C parser) in one pass over its events
that refuses nesting deeper than MAX_DEPTH and more than MAX_NODES nodes with every alias
expanded (a "billion laughs" file is a few hundred bytes), before anything is built; a mapping
key must be a scalar; an error message shows at most a short prefix of a value.
"""

import difflib
import os
import re
import reprlib
import stat

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


MAX_BYTES = 1 << 20  # a job or launcher config is a few KB
MAX_DEPTH = 64  # JobSpec nests 4 deep
MAX_NODES = 100_000  # scalars and collections, every alias expanded
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = 6
_SHOWN.maxlevel = 2
_BaseLoader = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader


def shown(value) -> str:
    """`repr(value)`, cut short: what an error message may show of a value."""
    return _SHOWN.repr(value)


class _Loader(_BaseLoader):  # type: ignore[misc,valid-type]
    """A safe loader (libyaml's parser) that rejects duplicate keys and non-scalar keys, and
    reads `3e-4` as a float (YAML 1.2 style; YAML 1.1 would make it a string, a classic
    surprise in learning-rate fields)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError(
                "", f"a mapping key must be a name, not a {key_node.id} (line {line})"
            )
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                key if isinstance(key, str) else shown(key), f"duplicate key (line {line})"
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _scalar(field: descriptor.FieldDescriptor, value, path: str):
    """The Python value a proto scalar field holds, or a ConfigError naming the path."""
    if field.type in _INT_TYPES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int, got {shown(value)}")
        low, high = _INT_TYPES[field.type]
        if not low <= value <= high:
            raise ConfigError(path, f"{value} is out of range [{low}, {high}]")
        return value
    if field.type in _FLOAT_TYPES:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {shown(value)}")
        return float(value)
    if field.type == descriptor.FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {shown(value)}")
        return value
    if field.type == descriptor.FieldDescriptor.TYPE_STRING:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {shown(value)} (quote it)")
        return value
    enum = field.enum_type  # set on every enum field
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM and enum is not None:
        names = [v.name for v in enum.values if not v.name.endswith("_UNSPECIFIED")]
        if isinstance(value, str):
            for v in enum.values:
                if v.name.lower() == value.lower():
                    return v.number
        raise ConfigError(path, f"expected one of {', '.join(names)}, got {shown(value)}")
    raise ConfigError(path, f"field type {field.type} cannot be set from YAML")


def fill_message(message, data, source: str | None = None, path: str = ""):
    """Sets `message`'s fields from a dict of proto field names; returns the message."""
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping of fields, got {shown(data)}", source)
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in data.items():
        key_path = _join(path, shown(key) if not isinstance(key, str) else key[:80])
        field = fields.get(key) if isinstance(key, str) else None
        if field is None:
            close = difflib.get_close_matches(str(key)[:80], list(fields), n=1)
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
            raise ConfigError(path, f"expected a list, got {shown(value)}")
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


def _read_config(path: str) -> str:
    """The text of `path`: a regular file of at most MAX_BYTES (opened without blocking, so a
    FIFO is refused rather than waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError("", "not a regular file (a FIFO, device or directory?)")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError("", f"larger than {MAX_BYTES} bytes: not a config")
    return data.decode("utf-8")


def _check_shape(text: str) -> None:
    """One pass over libyaml's events (no recursion, nothing built): nesting depth and the
    number of nodes with every alias expanded, each within bounds."""
    sizes: dict[str, int] = {}  # anchor -> nodes under it, expanded
    open_: list[list] = []  # [anchor, nodes so far] of each collection being read
    parser = _BaseLoader(text)
    try:
        while (event := parser.get_event()) is not None:
            if isinstance(event, yaml.CollectionStartEvent):
                open_.append([event.anchor, 1])
                if len(open_) > MAX_DEPTH:
                    line = event.start_mark.line + 1
                    raise ConfigError("", f"nested deeper than {MAX_DEPTH} (line {line})")
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                anchor, nodes = open_.pop()
            elif isinstance(event, yaml.AliasEvent):
                anchor, nodes = None, sizes.get(event.anchor, 1)
            elif isinstance(event, yaml.ScalarEvent):
                anchor, nodes = event.anchor, 1
            else:
                continue
            if anchor:
                sizes[anchor] = nodes
            if open_:
                open_[-1][1] += nodes
                if open_[-1][1] > MAX_NODES:
                    line = event.start_mark.line + 1
                    raise ConfigError(
                        "", f"more than {MAX_NODES} values with aliases expanded (line {line})"
                    )
    finally:
        parser.dispose()


def load_yaml(path: str):
    """The YAML document in `path`, or a ConfigError naming the file and the problem."""
    try:
        text = _read_config(path)
        _check_shape(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except OSError as e:
        raise ConfigError("", f"cannot read config: {e.strerror}", path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            "", f"not a UTF-8 text file (byte {e.start}): a YAML config?", path
        ) from None
    except ConfigError as e:
        raise ConfigError(e.field, e.problem, path) from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"not valid YAML: {str(e)[:500]}", path) from None


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
