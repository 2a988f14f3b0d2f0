"""push.py and base imports against a real registry (docker-registry on 127.0.0.1)."""

import hashlib
import json
import os
import subprocess

import pytest

from tools.oci import layout as oci
from tools.oci import testing


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with testing.local_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


def push(layout, registry, repository, tmp_path, tag="latest"):
    report = tmp_path / f"report-{os.urandom(4).hex()}.json"
    proc = testing.run_module(
        "tools.oci.push",
        "--layout",
        str(layout),
        "--repository",
        repository,
        "--registry",
        registry,
        "--tag",
        tag,
        "--report",
        str(report),
    )
    return proc.stdout, json.loads(report.read_text())


def test_pushed_digest_equals_local_and_a_second_push_uploads_nothing(registry, tmp_path):
    image = testing.build_image(tmp_path / "img")
    out, report = push(image.layout, registry, "kitchen/test", tmp_path)
    assert out.splitlines()[-1] == f"{registry}/kitchen/test@{image.digest}"
    assert report["upload_blobs"] == 3  # config + 2 layers
    assert report["upload_bytes"] == report["image_bytes"]

    remote_digest, body = testing.registry_manifest_digest(registry, "kitchen/test", "latest")
    assert remote_digest == image.digest
    assert "sha256:" + hashlib.sha256(body).hexdigest() == image.digest

    out, report = push(image.layout, registry, "kitchen/test", tmp_path)
    assert "uploaded 0 of 3 blobs, 0 B" in out
    assert report["upload_bytes"] == 0
    assert report["digest"] == image.digest


def test_a_one_line_change_uploads_only_the_app_layer_and_config(registry, tmp_path):
    before = testing.build_image(tmp_path / "before")
    push(before.layout, registry, "kitchen/change", tmp_path)
    after = testing.build_image(tmp_path / "after", app_extra_line="x = 2\n")
    _, report = push(after.layout, registry, "kitchen/change", tmp_path)
    app_layer = after.manifest["layers"][1]
    assert report["upload_blobs"] == 2
    assert report["upload_bytes"] == app_layer["size"] + after.manifest["config"]["size"]
    assert testing.registry_manifest_digest(registry, "kitchen/change", "latest")[0] == after.digest


def test_push_without_a_registry_says_how_to_give_one(tmp_path):
    image = testing.build_image(tmp_path / "img")
    env = {k: v for k, v in os.environ.items() if k != "KITCHEN_REGISTRY"}
    with pytest.raises(subprocess.CalledProcessError) as e:
        testing.run_module(
            "tools.oci.push", "--layout", str(image.layout), "--repository", "x", env=env
        )
    assert "--registry HOST:PORT is required" in e.value.stderr


def _import_base(out, *args):
    testing.run_module("tools.oci.base_image", "--out", str(out), "import", *args)
    config = json.loads((out / "config.json").read_text())
    layers = [json.loads((out / f"layer{i}.json").read_text()) for i in range(2)]
    return config, layers


def test_base_from_registry_by_digest_keeps_config_and_layers(registry, tmp_path):
    image = testing.build_image(tmp_path / "img")
    push(image.layout, registry, "kitchen/base", tmp_path)
    config, layers = _import_base(
        tmp_path / "base", "--image", f"{registry}/kitchen/base@{image.digest}"
    )
    assert config == image.config
    assert [d["digest"] for d in layers] == [d["digest"] for d in image.manifest["layers"]]
    assert [d["diff_id"] for d in layers] == image.config["rootfs"]["diff_ids"]
    for i, desc in enumerate(layers):
        data = (tmp_path / "base" / f"layer{i}.tar.gz").read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == desc["digest"]
    history = (tmp_path / "base" / "layers.txt").read_text().splitlines()
    assert history[0].startswith("deps layer [") and image.digest in history[0]


def test_base_from_a_registry_must_be_pinned_by_digest(registry, tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as e:
        _import_base(tmp_path / "base", "--image", f"{registry}/kitchen/base:latest")
    assert "must be pinned by digest" in e.value.stderr


def test_base_from_layout_checks_every_blob(tmp_path):
    image = testing.build_image(tmp_path / "img")
    config, layers = _import_base(
        tmp_path / "ok", "--layout", str(image.layout), "--digest", image.digest
    )
    assert config == image.config
    assert len(layers) == 2

    app_blob = oci.blob_path(str(image.layout), image.manifest["layers"][1]["digest"])
    os.chmod(app_blob, 0o644)
    with open(app_blob, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(subprocess.CalledProcessError) as e:
        _import_base(tmp_path / "bad", "--layout", str(image.layout), "--digest", image.digest)
    assert "does not match its digest" in e.value.stderr
