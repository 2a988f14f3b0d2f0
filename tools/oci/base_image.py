"""Makes a base image for `oci_image` (once per user and inputs): config.json + layerN blobs.

Two sources, both run by repository rules in repositories.bzl:

  debian  mmdebstrap --variant=minbase with the given packages at a fixed SOURCE_DATE_EPOCH.
          mmdebstrap's tar is already reproducible (same mirror state, same bytes); it is
          gzipped as is with a fixed gzip header.
  import  an image the user names by digest, from an OCI layout directory or from a
          registry (`skopeo copy`, which checks the pulled manifest against the digest).
          Every blob's sha256 is checked again while it is copied.

Output: a cache directory keyed by the inputs and this code, holding config.json and, for
each layer bottom first, layer<i>.tar.gz + layer<i>.json (descriptor with diff_id) and
layers.txt (one history line per layer). Its path is the last line printed.
"""

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

from tools.cache_dir import kitchen_cache_root
from tools.oci import layer_tar
from tools.oci import layout as oci

STAMP = ".complete"
GZIP_LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Documentation and translations are dead weight in a training image; copyright files stay.
DPKG_TRIM = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
]


def cache_key(inputs: dict) -> str:
    h = hashlib.sha256(oci.canonical_json(inputs))
    for module in (__file__, layer_tar.__file__, oci.__file__):
        with open(module, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def write_base(out: str, config: dict, descriptors: list[dict], history: list[str]) -> None:
    for i, descriptor in enumerate(descriptors):
        with open(os.path.join(out, f"layer{i}.json"), "w") as f:
            json.dump(descriptor, f, sort_keys=True, indent=1)
    with open(os.path.join(out, "layers.txt"), "w") as f:
        f.write("".join(line.replace("\n", " ") + "\n" for line in history))
    with open(os.path.join(out, "config.json"), "wb") as f:
        f.write(oci.canonical_json(config))


def build_debian(args, out: str) -> None:
    packages = ",".join(args.packages)
    command = [
        "mmdebstrap",
        f"--variant={args.variant}",
        f"--include={packages}",
        f"--architectures={args.architecture}",
        "--format=tar",
        *(f"--dpkgopt={opt}" for opt in DPKG_TRIM),
        args.suite,
        os.path.join(out, "rootfs.tar"),
        f"deb {args.mirror} {args.suite} main",
    ]
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(args.epoch))
    sys.stderr.write(f"base image: {' '.join(command)} (~30 s, first build only)\n")
    try:
        proc = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except FileNotFoundError:
        sys.exit("base image: mmdebstrap is not installed (apt-get install mmdebstrap)")
    if proc.returncode != 0:
        sys.exit(f"base image: mmdebstrap failed (mirror {args.mirror}):\n{proc.stdout[-4000:]}")
    descriptor = layer_tar.gzip_tar(
        os.path.join(out, "rootfs.tar"), os.path.join(out, "layer0.tar.gz")
    )
    os.remove(os.path.join(out, "rootfs.tar"))
    created_by = (
        f"mmdebstrap --variant={args.variant} --include={packages} {args.suite} "
        f"(SOURCE_DATE_EPOCH={args.epoch}, {args.mirror})"
    )
    config = {
        "architecture": args.architecture,
        "os": "linux",
        "created": oci.EPOCH,
        "config": {"Env": [f"PATH={DEBIAN_PATH}"]},
        "rootfs": {"type": "layers", "diff_ids": [descriptor["diff_id"]]},
        "history": [{"created": oci.EPOCH, "created_by": created_by}],
    }
    write_base(out, config, [descriptor], [created_by])


def copy_verified(source: str, dest: str, digest: str) -> None:
    h = hashlib.sha256()
    with open(source, "rb") as src, open(dest, "wb") as dst:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            dst.write(chunk)
    if "sha256:" + h.hexdigest() != digest:
        raise SystemExit(f"base image: blob {source} does not match its digest {digest}")


def import_layout(layout_dir: str, digest: str | None, out: str, source: str) -> None:
    manifest_digest, manifest, config = oci.read_image(layout_dir, digest)
    diff_ids = config["rootfs"]["diff_ids"]
    if len(diff_ids) != len(manifest["layers"]):
        sys.exit(
            f"base image: {source}: {len(manifest['layers'])} layers but {len(diff_ids)} diff_ids"
        )
    descriptors = []
    for i, (layer, diff_id) in enumerate(zip(manifest["layers"], diff_ids, strict=True)):
        if layer["mediaType"] not in GZIP_LAYER_TYPES:
            sys.exit(
                f"base image: {source}: layer {i} is {layer['mediaType']}; "
                "only gzip layers are supported"
            )
        copy_verified(
            oci.blob_path(layout_dir, layer["digest"]),
            os.path.join(out, f"layer{i}.tar.gz"),
            layer["digest"],
        )
        descriptors.append(
            {
                "mediaType": GZIP_LAYER_TYPES[0],
                "digest": layer["digest"],
                "size": layer["size"],
                "diff_id": diff_id,
            }
        )
    history = [
        h.get("created_by", "") for h in config.get("history", []) if not h.get("empty_layer")
    ]
    if len(history) != len(descriptors):
        history = [f"{source} layer {i}" for i in range(len(descriptors))]
    write_base(
        out, config, descriptors, [f"{line} [{source}@{manifest_digest}]" for line in history]
    )


def build_import(args, out: str) -> None:
    if args.layout:
        import_layout(args.layout, args.digest, out, args.layout)
        return
    name, sep, digest = args.image.partition("@")
    if not sep or not digest.startswith("sha256:"):
        sys.exit(f"base image: image {args.image!r} must be pinned by digest: HOST/NAME@sha256:...")
    tls = "false" if name.startswith(("127.", "localhost")) else "true"
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        command = [
            "skopeo",
            "copy",
            "--quiet",
            f"--src-tls-verify={tls}",
            f"docker://{args.image}",
            f"oci:{tmp}:base",
        ]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"base image: skopeo could not pull {args.image}:\n{proc.stderr.strip()}")
        import_layout(tmp, None, out, args.image)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="output directory (default: the per-user cache)")
    sub = parser.add_subparsers(dest="source", required=True)
    debian = sub.add_parser("debian", help="mmdebstrap a Debian rootfs")
    debian.add_argument("--suite", default="bookworm")
    debian.add_argument("--variant", default="minbase")
    debian.add_argument("--architecture", default="amd64")
    debian.add_argument("--packages", nargs="+", required=True)
    debian.add_argument("--epoch", type=int, required=True, help="SOURCE_DATE_EPOCH")
    debian.add_argument("--mirror", required=True, help="e.g. http://deb.debian.org/debian")
    imported = sub.add_parser("import", help="an existing image, pinned by digest")
    where = imported.add_mutually_exclusive_group(required=True)
    where.add_argument("--layout", help="OCI image layout directory")
    where.add_argument("--image", help="registry reference HOST/NAME@sha256:...")
    imported.add_argument("--digest", help="with --layout (required): the manifest digest")
    args = parser.parse_args()
    if args.source == "import" and args.layout and not args.digest:
        parser.error("import --layout needs --digest sha256:...: a base is pinned by digest")

    inputs = {k: v for k, v in vars(args).items() if k != "out"}
    if args.source == "import" and args.layout:
        inputs["layout"] = os.path.realpath(args.layout)
    out = args.out or os.path.join(kitchen_cache_root(), "oci", "base", cache_key(inputs))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(out, STAMP)):
            if os.path.exists(out):
                shutil.rmtree(out)  # left by an interrupted run
            os.makedirs(out)
            (build_debian if args.source == "debian" else build_import)(args, out)
            with open(os.path.join(out, STAMP), "w") as f:
                json.dump(inputs, f, sort_keys=True)
    print(out)


if __name__ == "__main__":
    main()
