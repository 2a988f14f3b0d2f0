"""numpy arrays as durable files for the precook manifests (the rest: protos/files.py)."""

import io

import numpy as np

from protos.files import FileDigest, write_bytes


def write_npy(path: str, array: np.ndarray) -> FileDigest:
    """`array` as a .npy file (no pickles), fsynced; its size and sha256."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return write_bytes(path, buf.getbuffer())
