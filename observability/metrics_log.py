"""Reads a run's metrics.jsonl: one kitchen.v1.Progress per line, as the trainer logs them.

The trainer writes each line with json_format (proto field names, int64 as strings, zero values
left out), so lines are parsed back into Progress messages rather than read as loose dicts.
"""

import json
from pathlib import Path
from typing import NamedTuple

from google.protobuf import json_format

from protos import progress_pb2


class MetricsLogError(ValueError):
    """A line of metrics.jsonl is not a Progress message; the message names file and line."""


class MetricsLog(NamedTuple):
    path: Path
    records: list  # progress_pb2.Progress, in file order
    warnings: list[str]


def find_metrics_file(run: str | Path) -> Path:
    """`run` is a run directory or a metrics.jsonl file."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a run directory's metrics.jsonl)")
    return path


def read_metrics_log(run: str | Path) -> MetricsLog:
    """Every Progress record of a run. A last line cut short (the trainer is writing it right
    now, or was killed mid-write) is skipped with a warning; any other bad line is an error."""
    path = find_metrics_file(run)
    text = path.read_text()
    lines = text.split("\n")
    records, warnings = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            records.append(json_format.ParseDict(obj, progress_pb2.Progress()))
        except (ValueError, json_format.ParseError) as err:
            unfinished = number == len(lines) and not text.endswith("\n")
            if unfinished:
                warnings.append(f"{path}:{number}: skipped an unfinished last line ({err})")
                continue
            raise MetricsLogError(f"{path}:{number}: not a kitchen.v1.Progress: {err}") from err
    if not records:
        raise MetricsLogError(f"{path}: no progress records")
    return MetricsLog(path, records, warnings)
