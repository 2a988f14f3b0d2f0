"""Pushes an OCI image layout to a registry with skopeo, keeping its digest.

    bazel run //images:push_trainer -- --registry HOST:PORT [--tag TAG] [--insecure]

Before copying it asks the registry which blobs it already has, so it can say how many bytes
this push really uploads (skopeo skips the blobs that exist). Pushing the same image twice
uploads nothing and prints the same digest. Loopback registries are reached over plain HTTP;
use --insecure for another plain-HTTP registry.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from tools.oci import layout as oci

LOOPBACK = ("127.", "localhost", "[::1]")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def registry_has_blob(base_url: str, repository: str, digest: str) -> bool | None:
    """True/False from the registry's HEAD answer; None when it will not say (auth, errors)."""
    request = urllib.request.Request(f"{base_url}/v2/{repository}/blobs/{digest}", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except urllib.error.HTTPError as e:
        return False if e.code == 404 else None
    except OSError:
        return None


def plan_upload(base_url: str, repository: str, manifest: dict) -> dict:
    blobs = [manifest["config"]] + manifest["layers"]
    answers = [registry_has_blob(base_url, repository, b["digest"]) for b in blobs]
    total = sum(b["size"] for b in blobs)
    if any(a is None for a in answers):
        return {
            "blobs": len(blobs),
            "image_bytes": total,
            "upload_blobs": None,
            "upload_bytes": None,
        }
    missing = [b for b, present in zip(blobs, answers, strict=True) if not present]
    return {
        "blobs": len(blobs),
        "image_bytes": total,
        "upload_blobs": len(missing),
        "upload_bytes": sum(b["size"] for b in missing),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", required=True, help="OCI image layout directory")
    parser.add_argument("--repository", required=True, help="e.g. kitchen/trainer")
    parser.add_argument("--tag", default="latest")
    parser.add_argument(
        "--registry",
        default=os.environ.get("KITCHEN_REGISTRY"),
        help="HOST:PORT ($KITCHEN_REGISTRY)",
    )
    parser.add_argument("--insecure", action="store_true", help="plain HTTP, no TLS verification")
    parser.add_argument("--report", help="also write the upload figures as JSON to this file")
    args = parser.parse_args()
    if not args.registry:
        parser.error("--registry HOST:PORT is required (or set KITCHEN_REGISTRY)")

    digest, manifest, _ = oci.read_image(args.layout)
    insecure = args.insecure or args.registry.startswith(LOOPBACK)
    base_url = ("http://" if insecure else "https://") + args.registry
    plan = plan_upload(base_url, args.repository, manifest)
    dest = f"{args.registry}/{args.repository}"

    with tempfile.TemporaryDirectory() as tmp:
        digest_file = os.path.join(tmp, "digest")
        command = [
            "skopeo",
            "copy",
            "--quiet",
            "--preserve-digests",
            f"--digestfile={digest_file}",
            f"--dest-tls-verify={'false' if insecure else 'true'}",
            f"oci:{os.path.realpath(args.layout)}:{oci.DEFAULT_TAG}",
            f"docker://{dest}:{args.tag}",
        ]
        try:
            proc = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError:
            sys.exit("push: skopeo is not installed (apt-get install skopeo)")
        if proc.returncode != 0:
            sys.exit(f"push: skopeo copy to {dest}:{args.tag} failed:\n{proc.stderr.strip()}")
        with open(digest_file) as f:
            pushed = f.read().strip()
    if pushed != digest:
        sys.exit(f"push: the registry stored {pushed}, but the local image is {digest}")

    if plan["upload_bytes"] is None:
        uploaded = "upload size unknown: the registry did not answer blob queries"
    else:
        share = 100.0 * plan["upload_bytes"] / plan["image_bytes"]
        uploaded = (
            f"uploaded {plan['upload_blobs']} of {plan['blobs']} blobs, "
            f"{human_bytes(plan['upload_bytes'])} of {human_bytes(plan['image_bytes'])} "
            f"({share:.3f}%)"
        )
    print(f"pushed {dest}:{args.tag} ({uploaded})")
    print(f"{dest}@{pushed}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(dict(plan, digest=pushed, reference=f"{dest}@{pushed}"), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
