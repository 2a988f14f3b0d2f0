"""Writes one reproducible layer from Bazel files; run by the `oci_layer` rule (oci.bzl).

Each `--file` is `RELATIVE_PATH=EXEC_PATH`: the file at EXEC_PATH lands at
PREFIX/RELATIVE_PATH in the image. A file is executable (0755) when it starts with `#!`,
else 0644: Bazel marks every generated file executable, so permission bits would say
nothing. The descriptor JSON (mediaType, digest, size, diff_id) is
what `oci_image` puts into the manifest and config.
"""

import argparse
import json
import os
import sys

from tools.oci import layer_tar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, fromfile_prefix_chars="@")
    parser.add_argument("--prefix", required=True, help="directory in the image, e.g. /opt/app")
    parser.add_argument("--file", action="append", default=[], metavar="REL=PATH")
    parser.add_argument("--level", type=int, default=layer_tar.DEFAULT_GZIP_LEVEL)
    parser.add_argument("--out", required=True, help="the .tar.gz blob to write")
    parser.add_argument("--descriptor", required=True, help="the descriptor JSON to write")
    args = parser.parse_args()
    if not args.prefix.startswith("/"):
        sys.exit(f"oci_layer: prefix {args.prefix!r} must be an absolute path in the image")

    entries = []
    for item in args.file:
        rel, sep, path = item.partition("=")
        if not sep or not rel or not path:
            sys.exit(f"oci_layer: --file {item!r} is not RELATIVE_PATH=EXEC_PATH")
        with open(path, "rb") as f:
            executable = f.read(2) == b"#!"
        entries.append(
            layer_tar.Entry(os.path.join(args.prefix, rel), source=path, executable=executable)
        )
    try:
        descriptor = layer_tar.write_layer(entries, args.out, args.level)
    except ValueError as e:
        sys.exit(f"oci_layer: {e}")
    with open(args.descriptor, "w") as f:
        json.dump(descriptor, f, sort_keys=True, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
