"""The errors precook raises for bad input: each names the config field or the file and line."""


class PrecookError(ValueError):
    """Input that precook cannot turn into a dataset; nothing has been left half-written."""


class DataConfigError(PrecookError):
    """A DataConfig value that cannot work. `field` is the proto field name, e.g. "seq_len"."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"data.{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self):  # raised in worker processes: must survive pickling
        return (type(self), (self.field, self.problem))


class CorpusError(PrecookError):
    """A file of the corpus that cannot be read or parsed; the message starts with file:line."""
