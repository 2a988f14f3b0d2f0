"""Durable file writes, torch-free, for every package: atomic replace, fsync, stable JSON.

`write_atomic(path, data)` is the one way Kitchen replaces a file that others read while it
runs (a manifest, a plot, a report, the launcher's handoff to an attempt): the bytes go to a
temporary file beside it, are fsynced, renamed over `path`, and the directory is fsynced, so a
reader sees the old file or the new one and a crash leaves no half-written file behind.
"""

import hashlib
import json
import os
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class FileDigest:
    """A written file as a manifest or a checkpoint's meta.json records it."""

    bytes: int
    sha256: str


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: str, final: str) -> None:
    """Rename the fully written directory `tmp` to `final`, removing an existing `final`
    first; its files (written with write_bytes: fsynced) and the rename made durable."""
    fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_bytes(path: str, data, mode: int = 0o666) -> FileDigest:
    """Write `data` (bytes-like) durably in place; return its size and sha256.

    `mode` is applied at creation (before any byte is written: a secret is never readable by
    others, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(len(memoryview(data).cast("B")), hashlib.sha256(data).hexdigest())


def json_bytes(obj) -> bytes:
    """Stable JSON (sorted keys, fixed indent): equal content gives equal bytes."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def write_atomic(path: str, data: bytes | str, mode: int = 0o666) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a part."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_bytes(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, obj, mode: int = 0o666) -> None:
    """`write_atomic` of `json_bytes(obj)`."""
    write_atomic(path, json_bytes(obj), mode)
