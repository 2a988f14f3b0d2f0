"""The errors precook raises for bad input: each names the config field or the file and line.

A config that cannot work at all is refused before precook starts, by the schema's own rules
(protos/validation.py: a `ConfigError`). These are what only reading the files can tell.
"""

from protos.config_yaml import ConfigError


class PrecookError(ValueError):
    """Input that precook cannot turn into a dataset; nothing has been left half-written."""


class DataConfigError(PrecookError, ConfigError):
    """A data field whose files do not work (data.input matches nothing, tokenizer_path does
    not load). `field` is the path, e.g. "data.input"; `data_field` the DataConfig field."""

    def __init__(self, data_field: str, problem: str):
        ConfigError.__init__(self, f"data.{data_field}", problem)
        self.data_field = data_field

    def __reduce__(self):  # raised in worker processes: must survive pickling
        return (type(self), (self.data_field, self.problem))


class CorpusError(PrecookError):
    """A file of the corpus that cannot be read or parsed; the message starts with file:line."""
