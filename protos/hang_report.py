"""What the trainer's hang watchdog found, on disk for the launcher to read.

The watchdog (trainer/health/watchdog.py) writes every rank's Python stacks to
`<run dir>/hang/rank-<R>.txt` and one `<run dir>/hang/report.json`; the launcher
(launcher/attempts.py) puts the report's message, which names the stuck rank and the dumps,
in the job's status. Torch-free, so both sides share one path rule and one format.
"""

import dataclasses
import json
import os

from protos.files import write_json_atomic

HANG_DIR = "hang"
REPORT_NAME = "report.json"


@dataclasses.dataclass(frozen=True)
class HangReport:
    step: int  # the step the stuck rank was on
    stuck_ranks: list[int]  # behind every other rank ([] : all ranks wait in one collective)
    stuck_hosts: list[str]  # their hosts, in the same order
    idle_seconds: float  # how long the first rank to notice had seen no progress
    dumps: str  # the directory holding rank-<R>.txt
    message: str  # one line: what the job's status says
    written_at: float  # time.time() when written


def hang_dir(run_dir: str) -> str:
    """`<run dir>/hang`: where the stack dumps and the report of a hung run go."""
    return os.path.join(run_dir, HANG_DIR)


def dump_path(run_dir: str, rank: int) -> str:
    return os.path.join(hang_dir(run_dir), f"rank-{rank}.txt")


def write_report(run_dir: str, report: HangReport) -> str:
    path = os.path.join(hang_dir(run_dir), REPORT_NAME)
    write_json_atomic(path, dataclasses.asdict(report))
    return path


def read_report(run_dir: str) -> HangReport | None:
    """The run's hang report, or None when there is none; a malformed one raises ValueError
    naming the file."""
    path = os.path.join(hang_dir(run_dir), REPORT_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a hang report: {e}") from e
    names = {f.name for f in dataclasses.fields(HangReport)}
    if not isinstance(data, dict) or set(data) != names:
        raise ValueError(f"{path}: not a hang report: expected the keys {sorted(names)}")
    return HangReport(**data)
