"""metrics.jsonl: a run's kitchen.v1.Progress records, one JSON object a line, torch-free.

The trainer appends one line per logged step and event (`append_progress`); its loss plot, its
tests and `kitchen report` read them back as Progress messages (`read_progress_log`). A line is
json_format with proto field names and every field present, so int64 fields are strings and a
NaN loss is "NaN": read lines back through the schema, not as loose dicts.

A run is resumed from checkpoints, so a step can be logged more than once (after a restart or a
loss-guard rollback); `last_per_step` is the one rule for which record of a step counts.
"""

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from protos import progress_pb2

LOG_NAME = "metrics.jsonl"


class ProgressLogError(ValueError):
    """A line of metrics.jsonl is not a Progress message; the message names file and line."""


@dataclass
class ProgressLog:
    path: Path
    records: list[progress_pb2.Progress]  # in file order
    warnings: list[str] = field(default_factory=list)  # lines skipped, with file and line


def log_path(run: str | Path) -> Path:
    """The metrics.jsonl of `run`, a run directory or the file itself."""
    path = Path(run)
    return path / LOG_NAME if path.is_dir() else path


def progress_line(p: progress_pb2.Progress) -> str:
    """One record as the line the log holds (without the newline)."""
    return json_format.MessageToJson(
        p,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        indent=None,
    )


def append_progress(path: str | Path, p: progress_pb2.Progress) -> None:
    """Append one record: a single write of a whole line, so a kill leaves at most the last
    line unfinished (and `drop_unfinished_last_line` removes it before the next attempt)."""
    with open(path, "a") as f:
        f.write(progress_line(p) + "\n")


def drop_unfinished_last_line(path: str | Path) -> int:
    """Cut a last line without its newline (an attempt was killed while writing it) so the next
    record starts a line of its own; returns the bytes dropped. Only the log's one writer, at
    start, may call this: a last line is unfinished only while nobody is writing it."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end == size:
            return 0
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())
    return size - end


def read_progress_log(run: str | Path) -> ProgressLog:
    """Every record of a run (a run directory or its metrics.jsonl), in file order.

    A last line without its newline that does not parse (the trainer is writing it now, or was
    killed mid-write) is skipped with a warning; any other bad line is a ProgressLogError naming
    file and line. A missing file is FileNotFoundError; an empty one has no records."""
    path = log_path(run)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no such file (expected a run directory or its {LOG_NAME})"
        ) from None
    lines = text.split("\n")
    log = ProgressLog(path, [])
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            log.records.append(json_format.ParseDict(obj, progress_pb2.Progress()))
        except (ValueError, json_format.ParseError) as err:
            if number == len(lines) and not text.endswith("\n"):
                log.warnings.append(f"{path}:{number}: skipped an unfinished last line ({err})")
                continue
            raise ProgressLogError(f"{path}:{number}: not a kitchen.v1.Progress: {err}") from err
    return log


def is_training_step(p: progress_pb2.Progress) -> bool:
    """A record of trained steps. Event lines ("checkpoint saved", "rolled back") repeat a
    step number with phase "train" but carry no step time."""
    return p.phase == "train" and p.step_time_seconds > 0


def is_eval(p: progress_pb2.Progress) -> bool:
    return p.phase == "eval"


def last_per_step(
    records: Iterable[progress_pb2.Progress],
    include: Callable[[progress_pb2.Progress], bool] = is_training_step,
) -> dict[int, progress_pb2.Progress]:
    """{step: record} of the records `include` accepts, in step order. A step logged again
    (redone after a resume or a rollback) keeps its last record: the one the final weights
    followed."""
    by_step = {p.step: p for p in records if include(p)}
    return dict(sorted(by_step.items()))
