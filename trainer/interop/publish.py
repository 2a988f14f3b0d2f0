"""A directory of files published at once: written beside its destination, fsynced, renamed.

An export or an import writes several files that only make sense together (weights, config,
tokenizer, checksums). Readers see the previous directory or the complete new one, never a
mix: a crash leaves a `.tmp-*` directory beside it, which the next publish removes.
"""

import os
import shutil
from pathlib import Path

from protos.files import FileDigest, json_bytes, replace_dir, write_bytes

CHECKSUMS = "kitchen_checksums.json"  # {file: {bytes, sha256}} of every other file


def publish(final: Path, files: dict[str, bytes], replaceable: bool) -> dict[str, FileDigest]:
    """Write `files` ({name: bytes}) as directory `final` plus CHECKSUMS; return the digests.

    An existing `final` is replaced only when `replaceable` says it is one of ours (a
    previous export); anything else there is refused with a FileExistsError."""
    final = Path(final)
    if final.exists() and not replaceable:
        raise FileExistsError(f"{final} exists and is not a Kitchen export: not overwriting it")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        digests = {name: write_bytes(str(tmp / name), data) for name, data in files.items()}
        record = {name: {"bytes": d.bytes, "sha256": d.sha256} for name, d in digests.items()}
        write_bytes(str(tmp / CHECKSUMS), json_bytes(record))
        replace_dir(str(tmp), str(final))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digests
