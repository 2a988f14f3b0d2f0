"""Where Kitchen keeps what outlives a Bazel output base: the toolchain's venvs, the OCI base
and dependency layers, unpacked images. One per-user directory shared by every clone, so a
second clone or `bazel clean --expunge` rebuilds none of it.

$KITCHEN_CACHE_DIR, else $XDG_CACHE_HOME/kitchen, else ~/.cache/kitchen.
(tools/lint/buildifier.bzl applies the same rule in Starlark.)
"""

import os


def kitchen_cache_root() -> str:
    if os.environ.get("KITCHEN_CACHE_DIR"):
        return os.environ["KITCHEN_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kitchen")
