"""Content-addressed cache of precooked directories, as a build system caches outputs.

A key is the sha256 of everything that decides the output: the bytes of every input file, the
tokenizer, the parameters and the format version. Equal keys mean equal outputs, so a present
and intact entry is reused without doing any work; any changed input byte or parameter gives a
new key, a miss. An entry is built in a private temporary directory and published with a single
rename under a per-key lock: readers see a complete entry or none, concurrent builders of one
key (e.g. several training ranks) build it once, and a killed build leaves only its temporary
directory, which the next build of that key removes.
"""

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable

from protos import files
from trainer.data import manifest
from trainer.data.manifest import M


def key_of(parts: dict) -> str:
    return hashlib.sha256(files.json_bytes(parts)).hexdigest()


class Cache:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def entry(self, kind: type[manifest.Manifest], name: str) -> str:
        """Where entry `name` of `kind` (a tokenized corpus or a dataset) lives."""
        return os.path.join(self.root, kind.CACHE_DIR, name)

    def lookup(self, kind: type[M], name: str, key: str) -> M | None:
        """The manifest of an intact entry for `key`, else None."""
        path = self.entry(kind, name)
        try:
            found = manifest.read_manifest(path, kind)
        except ValueError:
            return None
        if found.key != key or manifest.problem(path, found):
            return None
        return found

    @contextlib.contextmanager
    def _lock(self, name: str, say):
        os.makedirs(os.path.join(self.root, "locks"), exist_ok=True)
        with open(os.path.join(self.root, "locks", f"{name}.lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"waiting for another process precooking the same entry ({name})")
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def get_or_build(
        self,
        kind: type[M],
        name: str,
        key: str,
        build: Callable[[str], M],
        say: Callable[[str], None] = print,
    ) -> tuple[str, M, bool]:
        """(path, manifest, hit): the entry for `key`, built by `build(tmp_dir) -> manifest`
        into a temporary directory and published atomically if it is not there yet."""
        path = self.entry(kind, name)
        found = self.lookup(kind, name, key)
        if found is not None:
            return path, found, True
        with self._lock(name, say):
            found = self.lookup(kind, name, key)
            if found is not None:  # built by the process we waited for
                return path, found, True
            tmp_root = os.path.join(self.root, "tmp")
            os.makedirs(tmp_root, exist_ok=True)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            for stale in os.listdir(tmp_root):  # left by a killed build: we hold its lock
                if stale.startswith(f"{name}."):
                    shutil.rmtree(os.path.join(tmp_root, stale), ignore_errors=True)
            if os.path.exists(path):
                say(f"cache entry {path} is damaged or stale: rebuilding it")
                shutil.rmtree(path)
            tmp = tempfile.mkdtemp(prefix=f"{name}.", dir=tmp_root)
            try:
                made = build(tmp)
                files.replace_dir(tmp, path)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return path, made, False
