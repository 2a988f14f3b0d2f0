"""Deterministic OCI layer tarballs: same files in, same bytes (hence same digest) out.

What varies between two builds of the same sources, and how each is pinned here:
  - entry order: entries are sorted by their path in the image;
  - times and owners: mtime 0, uid/gid 0, no user/group names;
  - permissions: 0755 for directories and executable files, 0644 for everything else
    (callers may decide "executable" themselves: Bazel marks every output executable);
  - tar dialect: PAX, written by the standard library's tarfile;
  - gzip header: no file name, mtime 0 (the OS byte is fixed by Python's gzip module).
Compression output also depends on the zlib build, so the digest is stable per machine image
(Debian's zlib here), not across every zlib in the world.

The layer's two identities are computed while it is written: `diff_id` (sha256 of the
uncompressed tar, what the image config lists) and `digest` (sha256 of the gzip blob, what the
manifest and the registry use).
"""

import dataclasses
import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Iterable

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
DEFAULT_GZIP_LEVEL = 6


@dataclasses.dataclass(frozen=True)
class Entry:
    """One path in the layer. `source` is a file to copy (symlinks followed) or None."""

    path: str  # absolute path inside the image, e.g. /opt/kitchen/app/trainer/main.py
    source: str | None = None
    symlink_target: str | None = None  # set for a symbolic link; source is then None
    executable: bool | None = None  # None: from the source file's permission bits

    @property
    def is_dir(self) -> bool:
        return self.source is None and self.symlink_target is None


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, inner):
        self.inner = inner
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        if self.inner is not None:
            self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        if self.inner is not None:
            self.inner.flush()

    # The rest of the file-object interface tarfile.open asks for; its stream mode ("w|") only
    # writes.
    def read(self, size: int, /) -> bytes:
        raise io.UnsupportedOperation("write-only")

    def tell(self) -> int:
        return self.size

    def seek(self, pos: int, /) -> int:
        raise io.UnsupportedOperation("not seekable")

    def close(self) -> None:
        pass  # `inner` is closed by whoever opened it


def _tar_name(path: str) -> str:
    name = os.path.normpath(path).lstrip("/")
    if not path.startswith("/") or not name:
        raise ValueError(f"layer entry {path!r}: expected an absolute path inside the image")
    return name


def _with_parents(entries: Iterable[Entry]) -> list[Entry]:
    """Adds a directory entry for every parent path, and refuses two sources for one path."""
    by_name: dict[str, Entry] = {}
    for entry in entries:
        name = _tar_name(entry.path)
        previous = by_name.get(name)
        if previous is not None and previous != entry and not (previous.is_dir and entry.is_dir):
            raise ValueError(
                f"layer entry /{name} comes from two places: "
                f"{previous.source or previous.symlink_target} and "
                f"{entry.source or entry.symlink_target}"
            )
        by_name[name] = entry
        parent = os.path.dirname(name)
        while parent and parent not in by_name:
            by_name[parent] = Entry("/" + parent)
            parent = os.path.dirname(parent)
    return [by_name[name] for name in sorted(by_name)]


def _tar_info(name: str, entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.symlink_target is not None:
        info.type = tarfile.SYMTYPE
        info.linkname = entry.symlink_target
        info.mode = 0o777
    elif entry.source is not None:
        st = os.stat(entry.source)  # follows symlinks: Bazel's sandbox links every input
        info.type = tarfile.REGTYPE
        info.size = st.st_size
        executable = entry.executable if entry.executable is not None else st.st_mode & 0o111
        info.mode = 0o755 if executable else 0o644
    else:  # entry.is_dir
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    return info


def write_layer(entries: Iterable[Entry], out_path: str, level: int = DEFAULT_GZIP_LEVEL) -> dict:
    """Writes a gzip layer blob to out_path; returns its descriptor (with `diff_id`)."""
    ordered = _with_parents(entries)
    with open(out_path, "wb") as raw:
        compressed = _HashingWriter(raw)
        with gzip.GzipFile(
            filename="", mode="wb", compresslevel=level, fileobj=compressed, mtime=0
        ) as gz:
            uncompressed = _HashingWriter(gz)
            with tarfile.open(fileobj=uncompressed, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in ordered:
                    info = _tar_info(_tar_name(entry.path), entry)
                    if info.type == tarfile.REGTYPE:
                        assert entry.source is not None  # _tar_info: a file has a source
                        with open(entry.source, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
        raw.flush()
        os.fsync(raw.fileno())
    return {
        "mediaType": LAYER_MEDIA_TYPE,
        "digest": "sha256:" + compressed.sha256.hexdigest(),
        "size": compressed.size,
        "diff_id": "sha256:" + uncompressed.sha256.hexdigest(),
    }


def gzip_tar(tar_path: str, out_path: str, level: int = DEFAULT_GZIP_LEVEL) -> dict:
    """Compresses an already reproducible tar (mmdebstrap's) as is; returns its descriptor."""
    with open(tar_path, "rb") as src, open(out_path, "wb") as raw:
        compressed = _HashingWriter(raw)
        uncompressed = hashlib.sha256()
        with gzip.GzipFile(
            filename="", mode="wb", compresslevel=level, fileobj=compressed, mtime=0
        ) as gz:
            while chunk := src.read(1 << 20):
                uncompressed.update(chunk)
                gz.write(chunk)
        raw.flush()
        os.fsync(raw.fileno())
    return {
        "mediaType": LAYER_MEDIA_TYPE,
        "digest": "sha256:" + compressed.sha256.hexdigest(),
        "size": compressed.size,
        "diff_id": "sha256:" + uncompressed.hexdigest(),
    }


def tree_entries(root: str, dest: str, only: set[str] | None = None) -> list[Entry]:
    """Entries for the files under `root`, placed under `dest` in the image.

    Symbolic links inside the tree stay links. `only`, when given, is the set of paths
    (relative to root) to include; the rest of the tree is left out.
    """
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames) + [
            d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
        ]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if only is not None and rel not in only:
                continue
            target = os.path.join(dest, rel)
            if os.path.islink(full):
                entries.append(Entry(target, symlink_target=os.readlink(full)))
            else:
                entries.append(Entry(target, source=full))
    return entries
