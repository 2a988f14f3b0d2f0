"""Durable writes: every file fsynced, its size and sha256 returned for the manifest.

Precook writes a whole dataset into a temporary directory and publishes it with one rename
(cache.py), so single files need no rename of their own there; `write_atomic` is for files
written in place (a plot).
"""

import hashlib
import io
import json
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FileDigest:
    """A written file as a manifest or a checkpoint's meta.json records it."""

    bytes: int
    sha256: str


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_bytes(path: str, data) -> FileDigest:
    """Write `data` (bytes-like) durably; return its size and sha256."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(len(memoryview(data).cast("B")), hashlib.sha256(data).hexdigest())


def write_npy(path: str, array: np.ndarray) -> FileDigest:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return write_bytes(path, buf.getbuffer())


def json_bytes(obj) -> bytes:
    """Stable JSON (sorted keys, fixed indent): equal content gives equal bytes."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_bytes(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
