"""write_layer.py + write_image.py, run as the Bazel rules run them: valid, reproducible layouts."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from tools.oci import layout as oci
from tools.oci import testing


def test_layout_is_valid_for_oci_image_tool(tmp_path):
    image = testing.build_image(tmp_path / "img")
    proc = subprocess.run(
        ["oci-image-tool", "validate", "--type", "image", str(image.layout)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Validation succeeded" in proc.stdout


def test_same_inputs_give_the_same_digest(tmp_path):
    first = testing.build_image(tmp_path / "one")
    second = testing.build_image(tmp_path / "two")
    assert first.digest == second.digest
    for name in ("index.json", "oci-layout"):
        assert (first.layout / name).read_bytes() == (second.layout / name).read_bytes()


def test_one_line_app_change_changes_only_the_app_layer(tmp_path):
    before = testing.build_image(tmp_path / "before")
    after = testing.build_image(tmp_path / "after", app_extra_line="print('changed')\n")
    old_layers = [layer["digest"] for layer in before.manifest["layers"]]
    new_layers = [layer["digest"] for layer in after.manifest["layers"]]
    assert len(old_layers) == len(new_layers) == 2
    assert old_layers[0] == new_layers[0], "the dependency layer must not change"
    assert old_layers[1] != new_layers[1], "the app layer must change"
    assert before.digest != after.digest


def test_config_settings_and_unstamped_revision(tmp_path):
    image = testing.build_image(tmp_path / "img")
    runtime = image.config["config"]
    assert runtime["Entrypoint"] == ["python3", "-m", "app.main"]
    assert "APP_MODE=test" in runtime["Env"]
    assert runtime["WorkingDir"] == "/opt/app"
    assert runtime["Labels"]["org.opencontainers.image.revision"] == "unstamped"
    assert image.config["created"] == oci.EPOCH
    assert len(image.config["rootfs"]["diff_ids"]) == len(image.config["history"]) == 2


def test_stamped_build_fills_the_revision_and_changes_only_the_config(tmp_path):
    status = tmp_path / "stable-status.txt"
    status.write_text("BUILD_HOST box\nSTABLE_GIT_COMMIT 0123abcd\n")
    stamped = testing.build_image(tmp_path / "stamped", status=status)
    plain = testing.build_image(tmp_path / "plain")
    assert stamped.config["config"]["Labels"]["org.opencontainers.image.revision"] == "0123abcd"
    assert stamped.manifest["layers"] == plain.manifest["layers"]
    assert stamped.digest != plain.digest


def test_missing_status_key_is_named(tmp_path):
    status = tmp_path / "stable-status.txt"
    status.write_text("BUILD_HOST box\n")
    with pytest.raises(subprocess.CalledProcessError) as e:
        testing.build_image(tmp_path / "img", status=status)
    assert "{STABLE_GIT_COMMIT}" in e.value.stderr


def test_base_config_is_extended(tmp_path):
    base = testing.build_image(tmp_path / "base")
    base_config = tmp_path / "base" / "config.json"
    settings = {
        "base_config": str(base_config),
        "entrypoint": None,
        "cmd": ["--help"],
        "env": {"APP_MODE": "prod", "EXTRA": "1"},
        "workdir": None,
        "labels": {"org.opencontainers.image.title": "derived"},
        "created_by": ["extra layer"],
    }
    extra = testing.write_app_layer(tmp_path / "extra", "x = 1\n", name="extra")
    derived = testing.write_image(tmp_path / "derived", settings, base.layers + [extra])
    runtime = derived.config["config"]
    assert runtime["Entrypoint"] == ["python3", "-m", "app.main"], "kept from the base"
    assert runtime["Cmd"] == ["--help"]
    assert runtime["WorkingDir"] == "/opt/app"
    env = runtime["Env"]
    assert env.index("PATH=/usr/bin:/bin") == 0, "base variables keep their place"
    assert "APP_MODE=prod" in env and "APP_MODE=test" not in env and "EXTRA=1" in env
    assert runtime["Labels"]["org.opencontainers.image.title"] == "derived"
    assert runtime["Labels"]["org.opencontainers.image.revision"] == "unstamped"
    assert derived.config["rootfs"]["diff_ids"][:2] == base.config["rootfs"]["diff_ids"]
    assert [h["created_by"] for h in derived.config["history"]][-1] == "extra layer"


def test_base_whose_history_does_not_match_its_layers_is_refused(tmp_path):
    base = testing.build_image(tmp_path / "base")
    broken = dict(base.config, history=base.config["history"][:1])
    broken_path = tmp_path / "broken.json"
    broken_path.write_text(json.dumps(broken))
    settings = {"base_config": str(broken_path), "env": {}, "labels": {}, "created_by": []}
    with pytest.raises(subprocess.CalledProcessError) as e:
        testing.write_image(tmp_path / "out", settings, base.layers)
    assert "1 layer history entries for 2 layers" in e.value.stderr


def test_layer_prefix_must_be_absolute(tmp_path):
    src = tmp_path / "f.py"
    src.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.oci.write_layer", "--prefix", "opt/app"]
        + [
            "--file",
            f"f.py={src}",
            "--out",
            str(tmp_path / "o"),
            "--descriptor",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=testing.pythonpath()),
    )
    assert proc.returncode != 0
    assert "prefix 'opt/app' must be an absolute path" in proc.stderr


def test_bazel_layer_modes_come_from_content_not_permission_bits(tmp_path):
    script, module = tmp_path / "tool.sh", tmp_path / "mod.py"
    script.write_text("#!/bin/sh\necho hi\n")
    module.write_text("x = 1\n")
    os.chmod(script, 0o644)
    os.chmod(module, 0o755)  # how Bazel leaves generated files, e.g. *_pb2.py
    blob = tmp_path / "layer.tar.gz"
    testing.run_module(
        "tools.oci.write_layer",
        "--prefix=/opt/app",
        f"--file=tool.sh={script}",
        f"--file=mod.py={module}",
        f"--out={blob}",
        f"--descriptor={tmp_path / 'layer.json'}",
    )
    with tarfile.open(blob) as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
    assert modes["opt/app/tool.sh"] == 0o755
    assert modes["opt/app/mod.py"] == 0o644
