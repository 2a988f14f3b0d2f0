"""Pushes the built images to a real registry with //images:push_trainer's binary.

The registry (Debian's docker-registry) runs on 127.0.0.1 for this test only. The digest it
reports must be the local one, and a second push must upload nothing.
"""

import json
import os
import subprocess

import pytest

from tools.oci import layout as oci
from tools.oci import testing

LAYOUTS = {"trainer": os.environ["TRAINER_LAYOUT"], "launcher": os.environ["LAUNCHER_LAYOUT"]}
PUSH = os.environ["PUSH_BINARY"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with testing.local_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


def push(name, registry):
    proc = subprocess.run(
        [
            PUSH,
            "--layout",
            LAYOUTS[name],
            "--repository",
            f"kitchen/{name}",
            "--registry",
            registry,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("name", ["trainer", "launcher"])
def test_registry_digest_equals_local_and_a_second_push_uploads_nothing(registry, name):
    digest, manifest, _ = oci.read_image(LAYOUTS[name])
    blobs = 1 + len(manifest["layers"])

    first = push(name, registry)
    assert first.splitlines()[-1] == f"{registry}/kitchen/{name}@{digest}"
    assert f"uploaded {blobs} of {blobs} blobs" in first

    assert testing.registry_manifest_digest(registry, f"kitchen/{name}", "latest")[0] == digest
    inspect = subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", f"docker://{registry}/kitchen/{name}:latest"],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(inspect.stdout)
    assert info["Digest"] == digest
    assert info["Labels"]["org.opencontainers.image.title"] == f"kitchen-{name}"

    second = push(name, registry)
    assert f"uploaded 0 of {blobs} blobs, 0 B" in second
    assert second.splitlines()[-1] == first.splitlines()[-1]
