"""The two primitives of every validation module (protos/validation*.py): a rule that must
hold (`check`), and fields that must lie in the ranges protos/defaults.py gives them
(`check_range`, `check_ranges`). Each raises a ConfigError naming the field's path."""

from google.protobuf.message import Message

from protos import defaults
from protos.config_yaml import ConfigError
from protos.defaults import Field


def check(ok: bool, path: str, problem: str) -> None:
    """`problem` is what is wrong with the field at `path` when `ok` does not hold."""
    if not ok:
        raise ConfigError(path, problem)


def check_range(value, field: Field, path: str) -> None:
    problem = field.problem(value)
    if problem:
        raise ConfigError(path, problem)


def check_ranges(message: Message, section: str, path: str) -> None:
    """Every field of a defaulted config section (defaults.SECTIONS[section]) in its range."""
    for name, field in defaults.SECTIONS[section].items():
        check_range(getattr(message, name), field, f"{path}.{name}")
