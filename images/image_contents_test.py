"""The built trainer and launcher images: valid layouts, the intended layer split and labels."""

import functools
import os
import subprocess
import tarfile

import pytest

from tools.oci import layout as oci

LAYOUTS = {"trainer": os.environ["TRAINER_LAYOUT"], "launcher": os.environ["LAUNCHER_LAYOUT"]}
APP = "opt/kitchen/app/"
SITE = "opt/kitchen/site-packages/"


@functools.cache
def scan_layer(layout: str, digest: str) -> tuple[list[str], dict[str, str]]:
    """One pass over a layer: its member names and the text of its pip RECORD files."""
    names, records = [], {}
    with tarfile.open(oci.blob_path(layout, digest), mode="r|gz") as tar:
        for member in tar:
            names.append(member.name)
            if member.name.endswith(".dist-info/RECORD"):
                record = tar.extractfile(member)
                assert record is not None, f"{member.name} is not a regular file"
                records[member.name] = record.read().decode()
    return names, records


def layer_names(layout: str, descriptor: dict) -> list[str]:
    return scan_layer(layout, descriptor["digest"])[0]


@pytest.fixture(scope="module")
def images():
    return {name: oci.read_image(path) for name, path in LAYOUTS.items()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_oci_image_tool_validates_the_layout(name):
    proc = subprocess.run(
        ["oci-image-tool", "validate", "--type", "image", LAYOUTS[name]],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Validation succeeded" in proc.stdout


def test_trainer_layers_are_split_for_caching(images):
    _, manifest, config = images["trainer"]
    layout = LAYOUTS["trainer"]
    history = [h["created_by"] for h in config["history"]]
    assert len(manifest["layers"]) == 5, history
    assert history[0].startswith("mmdebstrap --variant=minbase --include=python3 bookworm")
    torch_layer, triton_layer, deps_layer, app_layer = manifest["layers"][1:]

    torch_names = layer_names(layout, torch_layer)
    assert f"{SITE}torch/__init__.py" in torch_names
    assert f"{SITE}numpy/__init__.py" in torch_names
    assert not any(n.startswith(f"{SITE}triton/") for n in torch_names)
    triton_names = layer_names(layout, triton_layer)
    assert f"{SITE}triton/__init__.py" in triton_names
    assert {n.split("/")[3] for n in triton_names if n.count("/") >= 3} <= {
        "triton",
        "triton-3.8.0.dist-info",
    }

    deps_names = layer_names(layout, deps_layer)
    assert f"{SITE}grpc/__init__.py" in deps_names
    assert f"{SITE}fastapi/__init__.py" in deps_names  # kind: serve
    assert not any(n.startswith((f"{SITE}torch/", f"{SITE}numpy/")) for n in deps_names), (
        "packages of the torch layer must not be repeated in the deps layer"
    )

    app_names = [n for n in layer_names(layout, app_layer) if n.endswith(".py")]
    assert all(n.startswith(APP) for n in app_names)
    assert f"{APP}trainer/main.py" in app_names
    assert f"{APP}trainer/serve/server.py" in app_names
    assert f"{APP}kernels/__init__.py" in app_names
    assert f"{APP}protos/job_pb2.py" in app_names, "generated protobuf modules ship in the app"
    assert not any(n.startswith(f"{APP}launcher/") for n in app_names)


def test_dependency_layers_carry_deterministic_bytecode(images):
    _, manifest, _ = images["trainer"]
    with tarfile.open(oci.blob_path(LAYOUTS["trainer"], manifest["layers"][1]["digest"])) as tar:
        member = tar.getmember(f"{SITE}torch/__pycache__/__init__.cpython-311.pyc")
        pyc = tar.extractfile(member)
        assert pyc is not None, f"{member.name} is not a regular file"
        header = pyc.read(16)
    flags = int.from_bytes(header[4:8], "little")
    assert flags == 0b11, "checked-hash .pyc (PEP 552): valid without file timestamps"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dependency_layers_hold_nothing_of_the_build_machine(images, name):
    """No console scripts (their shebangs name the build venv), nor RECORD lines for them."""
    _, manifest, _ = images[name]
    for layer in manifest["layers"][1:-1]:
        names, records = scan_layer(LAYOUTS[name], layer["digest"])
        assert records, "every dependency layer holds pip RECORD files"
        assert not any(n.startswith(f"{SITE}bin/") for n in names)
        for record, text in records.items():
            paths = [line.split(",")[0] for line in text.splitlines()]
            assert not any(p.startswith(("../", "bin/")) for p in paths), record


def test_launcher_image_has_no_torch_and_no_trainer(images):
    _, manifest, config = images["launcher"]
    assert len(manifest["layers"]) == 3  # base, launcher deps, app
    names = [n for layer in manifest["layers"][1:] for n in layer_names(LAYOUTS["launcher"], layer)]
    for forbidden in ("torch", "triton", "numpy"):
        assert not any(n.startswith(f"{SITE}{forbidden}/") for n in names), forbidden
    assert not any(n.startswith(f"{APP}trainer/") for n in names)
    assert f"{APP}launcher/server.py" in names
    assert f"{APP}launcher/cli.py" in names
    assert f"{SITE}prometheus_client/__init__.py" in names


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_config_labels_and_settings(images, name):
    _, _, config = images[name]
    runtime = config["config"]
    labels = runtime["Labels"]
    assert labels["org.opencontainers.image.title"] == f"kitchen-{name}"
    assert labels["org.opencontainers.image.revision"], "stamped builds carry the commit"
    assert runtime["Entrypoint"][:2] == ["python3", "-m"]
    assert "PYTHONPATH=/opt/kitchen/app:/opt/kitchen/site-packages" in runtime["Env"]
    assert config["created"] == oci.EPOCH


def test_both_images_share_the_base_layer(images):
    trainer_base = images["trainer"][1]["layers"][0]["digest"]
    launcher_base = images["launcher"][1]["layers"][0]["digest"]
    assert trainer_base == launcher_base
