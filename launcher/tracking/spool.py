"""A bounded, durable queue of tracking batches on disk: what is not yet in MLflow.

Each batch is one JSON file written atomically (protos/files.write_atomic), named by a
zero-padded sequence number so the directory listing is the sending order; a batch leaves the
spool only after MLflow took all of it. A launcher restarted with batches in its spool sends
them first. Resending a batch is harmless: its metric values carry the timestamps they were
recorded with, and MLflow keeps one copy of an identical (key, value, step, timestamp); params
and tags are sent with the same values again.

Bounded: past `max_bytes` the oldest batches are dropped (and counted), so an MLflow server
gone for days cannot fill the launcher's disk; the run directory's metrics.jsonl still holds
every step (`kitchen track import` sends it after the fact).
"""

import json
import os
import threading
from dataclasses import dataclass, field

from launcher.tracking.records import Point
from protos.files import json_bytes, write_atomic

SUFFIX = ".json"


@dataclass
class Batch:
    """Records for one job's run: create it if needed, then log, then maybe end it."""

    job_id: str
    experiment: str
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    # (file, directory in the run's artifacts): files to upload when the batch is sent
    artifacts: list[tuple[str, str]] = field(default_factory=list)
    documents: dict[str, dict] = field(default_factory=dict)  # artifact path -> JSON object
    status: str = ""  # "" running; else MLflow's RunStatus name: FINISHED, FAILED, KILLED

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id, "experiment": self.experiment, "tags": self.tags,
            "params": self.params, "points": [p.to_json() for p in self.points],
            "artifacts": self.artifacts, "documents": self.documents, "status": self.status,
        }  # fmt: skip

    @classmethod
    def from_json(cls, obj: dict) -> "Batch":
        return cls(
            obj["job_id"], obj["experiment"], obj["tags"], obj["params"],
            [Point(**p) for p in obj["points"]], [(f, d) for f, d in obj["artifacts"]],
            obj["documents"], obj["status"],
        )  # fmt: skip


class SpoolError(ValueError):
    """A spool file that is not a batch; the message names the file."""


class Spool:
    def __init__(self, directory: str, max_bytes: int):
        self.dir = directory
        self.max_bytes = max_bytes
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        names = self._names()
        self._next = int(names[-1].split(".")[0]) + 1 if names else 0

    def _names(self) -> list[str]:
        # Temporary files of an interrupted write end in .tmp-<pid>: not batches.
        return sorted(n for n in os.listdir(self.dir) if n.endswith(SUFFIX))

    def put(self, batch: Batch) -> int:
        """Store `batch` durably; returns how many old batches were dropped to stay bounded."""
        data = json_bytes(batch.to_json())
        with self._lock:
            name = f"{self._next:012d}{SUFFIX}"
            self._next += 1
            write_atomic(os.path.join(self.dir, name), data)
            return self._trim()

    def _trim(self) -> int:
        names = self._names()
        sizes = [os.path.getsize(os.path.join(self.dir, n)) for n in names]
        total, dropped = sum(sizes), 0
        for name, size in zip(names[:-1], sizes, strict=False):  # never the newest
            if total <= self.max_bytes:
                break
            os.unlink(os.path.join(self.dir, name))
            total -= size
            dropped += 1
        return dropped

    def pending(self) -> list[str]:
        """Paths of the waiting batches, oldest first."""
        with self._lock:
            return [os.path.join(self.dir, n) for n in self._names()]

    def load(self, path: str) -> Batch:
        try:
            with open(path, encoding="utf-8") as f:
                return Batch.from_json(json.load(f))
        except (ValueError, KeyError, TypeError) as err:
            raise SpoolError(f"{path}: not a tracking batch ({err})") from err

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # dropped by _trim while it was being sent
