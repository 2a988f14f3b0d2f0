"""OCI image layouts (image-spec v1.0): canonical JSON blobs, config, manifest, index.

JSON is written canonically (sorted keys, no spaces, UTF-8) so that the same content always
has the same digest. Layouts are read back by the push, run and test tools through
`read_image`.
"""

import hashlib
import json
import os
import shutil

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"
DEFAULT_TAG = "latest"
# Fixed creation time: a timestamp would make every build a new image.
EPOCH = "1970-01-01T00:00:00Z"


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(layout: str, digest: str) -> str:
    algorithm, hexdigest = digest.split(":", 1)
    return os.path.join(layout, "blobs", algorithm, hexdigest)


def write_json_blob(layout: str, obj, media_type: str) -> dict:
    data = canonical_json(obj)
    digest = sha256_digest(data)
    path = blob_path(layout, digest)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def add_blob_file(layout: str, source: str, digest: str) -> None:
    """Puts an existing blob into the layout: a hard link when possible (layers are large)."""
    path = blob_path(layout, digest)
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    real = os.path.realpath(source)
    try:
        os.link(real, path)
    except OSError:
        shutil.copyfile(real, path)


def layer_descriptor(descriptor: dict) -> dict:
    """The manifest's view of a layer: the descriptor without our `diff_id` bookkeeping."""
    return {k: descriptor[k] for k in ("mediaType", "digest", "size")}


def write_layout(layout: str, config: dict, layers: list[dict], tag: str = DEFAULT_TAG) -> str:
    """Writes config, manifest, index.json and oci-layout; layer blobs must already be there.

    Returns the manifest digest, the image's identity in a registry.
    """
    config_desc = write_json_blob(layout, config, CONFIG_MEDIA_TYPE)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config_desc,
        "layers": [layer_descriptor(d) for d in layers],
    }
    manifest_desc = write_json_blob(layout, manifest, MANIFEST_MEDIA_TYPE)
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [dict(manifest_desc, annotations={REF_NAME: tag})],
    }
    with open(os.path.join(layout, "index.json"), "wb") as f:
        f.write(canonical_json(index))
    with open(os.path.join(layout, "oci-layout"), "wb") as f:
        f.write(canonical_json({"imageLayoutVersion": "1.0.0"}))
    return manifest_desc["digest"]


def _read_blob_json(layout: str, digest: str):
    with open(blob_path(layout, digest), "rb") as f:
        return json.load(f)


def read_image(layout: str, digest: str | None = None) -> tuple[str, dict, dict]:
    """Returns (manifest digest, manifest, config) of the image in `layout`.

    `digest` picks a manifest (directly in index.json or inside a nested index); without it
    the layout must hold exactly one image.
    """
    index_path = os.path.join(layout, "index.json")
    if not os.path.exists(index_path):
        raise FileNotFoundError(f"{layout}: not an OCI image layout (no index.json)")
    with open(index_path) as f:
        index = json.load(f)
    candidates = list(index.get("manifests", []))
    manifests = []
    while candidates:
        desc = candidates.pop(0)
        if desc.get("mediaType") == INDEX_MEDIA_TYPE:
            candidates.extend(_read_blob_json(layout, desc["digest"]).get("manifests", []))
        else:
            manifests.append(desc)
    if digest is not None:
        manifests = [m for m in manifests if m["digest"] == digest]
        if not manifests:
            raise LookupError(f"{layout}: no image manifest with digest {digest}")
    elif len(manifests) != 1:
        found = ", ".join(m["digest"] for m in manifests) or "none"
        raise LookupError(f"{layout}: expected exactly one image, found {found}; give a digest")
    manifest_digest = manifests[0]["digest"]
    manifest = _read_blob_json(layout, manifest_digest)
    config = _read_blob_json(layout, manifest["config"]["digest"])
    return manifest_digest, manifest, config
