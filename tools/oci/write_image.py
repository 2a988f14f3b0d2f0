"""Writes an OCI image layout: a base image's layers and config plus new layers and settings.

Run by the `oci_image` rule (oci.bzl). Layers arrive as (blob, descriptor JSON) pairs in
order, base layers first; the image settings arrive as one JSON file:
  {"entrypoint": [...]|null, "cmd": [...]|null, "env": {"K": "V"}, "workdir": str|null,
   "labels": {"k": "v"}, "base_config": path|null, "created_by": [str per new layer]}
Label values may hold `{STATUS_KEY}` placeholders, filled from Bazel's workspace status
files when the build is stamped and set to "unstamped" otherwise, so unstamped builds stay
reproducible.
"""

import argparse
import json
import os
import re
import sys

from tools.oci import layout as oci

UNSTAMPED = "unstamped"
_PLACEHOLDER = re.compile(r"\{([A-Z][A-Z0-9_]*)\}")


def read_status(paths: list[str]) -> dict[str, str]:
    """Bazel's stable/volatile status files: one `KEY value` per line."""
    status = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                key, _, value = line.rstrip("\n").partition(" ")
                if key:
                    status[key] = value
    return status


def fill_placeholders(value: str, status: dict[str, str] | None) -> str:
    def replace(match: re.Match) -> str:
        if status is None:
            return UNSTAMPED
        if match.group(1) not in status:
            sys.exit(
                f"oci_image: label placeholder {{{match.group(1)}}} is not in the workspace "
                "status; add it to --workspace_status_command (see tools/oci/workspace_status.sh)"
            )
        return status[match.group(1)]

    return _PLACEHOLDER.sub(replace, value)


def merge_env(base: list[str], extra: dict[str, str]) -> list[str]:
    """Docker's rule: a later value for the same variable replaces the earlier one in place."""
    merged = dict(item.split("=", 1) for item in base)
    merged.update(extra)
    return [f"{k}={v}" for k, v in merged.items()]


def build_config(settings: dict, base: dict | None, layers: list[dict], status) -> dict:
    base = base or {"architecture": "amd64", "os": "linux", "config": {}, "history": []}
    runtime = dict(base.get("config") or {})
    if settings.get("entrypoint") is not None:
        runtime["Entrypoint"] = settings["entrypoint"]
        runtime.pop("Cmd", None)  # a new entrypoint makes the base's arguments meaningless
    if settings.get("cmd") is not None:
        runtime["Cmd"] = settings["cmd"]
    if settings.get("workdir"):
        runtime["WorkingDir"] = settings["workdir"]
    runtime["Env"] = merge_env(runtime.get("Env", []), settings.get("env", {}))
    labels = dict(runtime.get("Labels") or {})
    labels.update({k: fill_placeholders(v, status) for k, v in settings.get("labels", {}).items()})
    if labels:
        runtime["Labels"] = labels
    history = list(base.get("history", []))
    history += [{"created": oci.EPOCH, "created_by": by} for by in settings["created_by"]]
    return {
        "architecture": base.get("architecture", "amd64"),
        "os": base.get("os", "linux"),
        "created": oci.EPOCH,
        "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": [d["diff_id"] for d in layers]},
        "history": history,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--settings", required=True, help="JSON file with the image settings")
    parser.add_argument("--layer", nargs=2, action="append", default=[], metavar=("BLOB", "DESC"))
    parser.add_argument("--status", action="append", default=[], help="stamp: Bazel status file")
    parser.add_argument("--out", required=True, help="layout directory to create")
    parser.add_argument(
        "--config-out", required=True, help="copy of the config, for derived images"
    )
    args = parser.parse_args()

    with open(args.settings) as f:
        settings = json.load(f)
    base = None
    if settings.get("base_config"):
        with open(settings["base_config"]) as f:
            base = json.load(f)
    descriptors = []
    os.makedirs(args.out, exist_ok=True)
    for blob, desc_path in args.layer:
        with open(desc_path) as f:
            desc = json.load(f)
        oci.add_blob_file(args.out, blob, desc["digest"])
        descriptors.append(desc)
    status = read_status(args.status) if args.status else None
    config = build_config(settings, base, descriptors, status)
    layer_history = [h for h in config["history"] if not h.get("empty_layer")]
    if len(config["rootfs"]["diff_ids"]) != len(layer_history):
        sys.exit(
            f"oci_image: {len(layer_history)} layer history entries for "
            f"{len(config['rootfs']['diff_ids'])} layers; the base config does not match its layers"
        )
    oci.write_layout(args.out, config, descriptors)
    with open(args.config_out, "wb") as f:
        f.write(oci.canonical_json(config))


if __name__ == "__main__":
    main()
