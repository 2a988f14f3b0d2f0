"""A distributed checkpoint (dcp/) may be another team's file: check it holds data, not code.

torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain `pickle.load`, and
each non-tensor value (an optimizer's step count, its param_groups) with
`torch.load(weights_only=False)`: a crafted `dcp/` would run any code when a job resumes from
it. `check(path)` reads both first, safely: `.metadata` with an unpickler that builds only
DCP's own metadata classes, torch.Size, dtypes and paths, and every byte item with torch's
weights-only unpickler. Only then does dcp.load read them for real (trainer/parallel/dcp.py).
"""

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

METADATA_FILE = ".metadata"
# (module, name) a DCP metadata pickle may name besides DCP's metadata classes and dtypes.
ALLOWED = {
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        known = (module, name) in ALLOWED or _is_metadata_class(module, name)
        if known or _is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def _is_metadata_class(module: str, name: str) -> bool:
    return module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type)


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def check(path: Path) -> None:
    """Raises pickle.UnpicklingError naming the file unless `path` (a dcp/ directory) holds
    only data."""
    where = Path(path) / METADATA_FILE
    try:
        with open(where, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"{where}: refused, it could run code: {e}") from None
    if not isinstance(meta, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"{where}: not a distributed checkpoint's metadata")
    for index, info in (meta.storage_data or {}).items():
        item = meta.state_dict_metadata.get(index.fqn)
        if not isinstance(item, dcp_metadata.BytesStorageMetadata):
            continue  # tensors are read as raw bytes, never unpickled
        if getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"{path}: {index.fqn}: transformed bytes are not read")
        blob = _read(Path(path), info.relative_path, info.offset, info.length)
        try:
            torch.load(io.BytesIO(blob), weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"{path}: {index.fqn}: refused: {e}") from None


def _read(root: Path, relative: str, offset: int, length: int) -> bytes:
    file = (root / relative).resolve()
    if not file.is_relative_to(root.resolve()) or os.sep in relative:
        raise pickle.UnpicklingError(f"{root}: {relative!r} is not a file of the checkpoint")
    with open(file, "rb") as f:
        f.seek(offset)
        return f.read(length)
