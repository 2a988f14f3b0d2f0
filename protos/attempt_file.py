"""Where an attempt's handoff lives in a run directory, and reading it back (torch-free).

`<run_dir>/attempts/<NNN>/attempt.json`: the `kitchen.v1.Attempt` the launcher wrote before
starting attempt NNN (launcher/executors/handoff.py). Read back by `kitchen track import` and
`kitchen diff` (the job as run) and by `run:NAME` references made by hand (protos/run_refs.py).
"""

import os

from google.protobuf import json_format

from protos import attempt_pb2

ATTEMPTS_DIR = "attempts"
ATTEMPT_FILE = "attempt.json"
OUTPUT_LOG = "output.log"  # the attempt's stdout and stderr, as the executor's wrapper saw them


def attempt_dir(run_dir: str, attempt: int) -> str:
    return os.path.join(run_dir, ATTEMPTS_DIR, f"{attempt:03d}")


def newest_attempt(run_dir: str) -> attempt_pb2.Attempt | None:
    """The newest attempt of `run_dir` that has a handoff file; None without one. ValueError
    naming the file when it is not an Attempt."""
    root = os.path.join(run_dir, ATTEMPTS_DIR)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in reversed(names):
        path = os.path.join(root, name, ATTEMPT_FILE)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    return json_format.Parse(f.read(), attempt_pb2.Attempt())
            except (json_format.ParseError, UnicodeDecodeError) as err:
                raise ValueError(f"{path}: not a kitchen.v1.Attempt: {err}") from err
    return None
