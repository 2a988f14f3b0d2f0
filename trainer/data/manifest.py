"""manifest.json: what a precooked directory holds, and the check that it holds it.

A directory is published only once complete (cache.py), and its manifest lists every other
file with its size and sha256, so a reader can tell a sound directory from a damaged one.
"""

import json
import os

from trainer.data import files

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def read_manifest(path: str) -> dict:
    """The manifest of a precooked directory; ValueError naming the file if it is not one."""
    name = os.path.join(path, MANIFEST)
    try:
        with open(name, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not a precooked dataset (no {MANIFEST})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not valid JSON ({err})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{name}: format version {manifest.get('format_version')}, this code reads "
            f"{FORMAT_VERSION}: precook it again"
        )
    return manifest


def write_manifest(directory: str, manifest: dict) -> None:
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    files.write_bytes(os.path.join(directory, MANIFEST), files.json_bytes(manifest))


def problem(path: str, manifest: dict) -> str | None:
    """Why the directory does not match its manifest (a missing, resized or changed file),
    or None when it does."""
    for rel, want in sorted(manifest["files"].items()):
        name = os.path.join(path, rel)
        try:
            size = os.path.getsize(name)
        except OSError:
            return f"{rel} is missing"
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {want['bytes']}"
        if files.sha256_file(name) != want["sha256"]:
            return f"{rel} does not match its sha256 in the manifest"
    return None
