"""//images:trainer_cuda: the NVIDIA libraries in layers of their own below torch, the layers
above shared with the CPU trainer image, and inside the image (bwrap, no GPU here) torch is a
CUDA build and the trainer imports. Tag manual: the image is about 3 GB of gzip blobs."""

import functools
import json
import os
import subprocess
import sys
import tarfile

import pytest

from tools.oci import layout as oci
from tools.oci import testing

CUDA = os.environ["TRAINER_CUDA_LAYOUT"]
CPU = os.environ["TRAINER_LAYOUT"]
SITE = "opt/kitchen/site-packages/"
NVIDIA_LAYERS = ("cuda_math", "cuda_cudnn", "cuda_runtime")

PROBE = """
import json, torch, importlib
mods = ["trainer.main", "trainer.loop", "trainer.fp8", "kernels", "triton"]
for m in mods:
    importlib.import_module(m)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.is_available(),
                  "imported": mods}))
"""


@pytest.fixture(scope="module")
def images():
    return {"cuda": oci.read_image(CUDA), "cpu": oci.read_image(CPU)}


@functools.cache
def layer_names(layout: str, digest: str) -> list[str]:
    with tarfile.open(oci.blob_path(layout, digest), mode="r|gz") as tar:
        return [member.name for member in tar]


def packages(layout: str, digest: str) -> set[str]:
    """The top-level names a layer installs under site-packages."""
    names = layer_names(layout, digest)
    return {n[len(SITE) :].split("/")[0] for n in names if n.startswith(SITE) and n != SITE}


def run_image(cache_dir, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tools.oci.run_image", "--layout", CUDA]
    command += ["--cache-dir", str(cache_dir), *args]
    env = dict(os.environ, PYTHONPATH=testing.pythonpath())
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)


def test_nvidia_libraries_sit_in_their_own_layers_below_torch(images):
    _, manifest, config = images["cuda"]
    history = [h["created_by"] for h in config["history"]]
    assert len(manifest["layers"]) == 8, history  # base, 3 NVIDIA, torch, triton, deps, app
    nvidia = [layer["digest"] for layer in manifest["layers"][1:4]]
    for layer, name in zip(nvidia, NVIDIA_LAYERS, strict=True):
        tops = packages(CUDA, layer)
        assert tops and all(t.startswith(("nvidia", "cuda")) for t in tops), (name, tops)
    assert "nvidia" in packages(CUDA, nvidia[1])  # cudnn
    assert any(n.endswith("libcudnn.so.9") for n in layer_names(CUDA, nvidia[1]))
    assert any(n.endswith("libcublas.so.13") for n in layer_names(CUDA, nvidia[0]))
    assert any(n.endswith("libnccl.so.2") for n in layer_names(CUDA, nvidia[2]))
    torch_names = layer_names(CUDA, manifest["layers"][4]["digest"])
    assert f"{SITE}torch/lib/libtorch_cuda.so" in torch_names
    assert not any(n.startswith(f"{SITE}nvidia/") for n in torch_names)


def test_the_layers_above_torch_are_the_cpu_images_own_blobs(images):
    """triton, the other dependencies and the app: one blob each in a registry for both
    images, and an app change replaces only the top layer of either."""
    cuda_layers = [layer["digest"] for layer in images["cuda"][1]["layers"]]
    cpu_layers = [layer["digest"] for layer in images["cpu"][1]["layers"]]
    assert cuda_layers[0] == cpu_layers[0]  # the Debian base
    assert cuda_layers[-3:] == cpu_layers[-3:]  # triton, trainer_deps, app
    labels = images["cuda"][2]["config"]["Labels"]
    assert labels["org.opencontainers.image.title"] == "kitchen-trainer-cuda"


def test_torch_in_the_image_is_a_cuda_build_and_the_trainer_imports(tmp_path):
    proc = run_image(tmp_path, "--entrypoint", f"python3 -c '{PROBE}'")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] == "2.14.1+cu130" and got["cuda"] == "13.0", got  # a CUDA build
    assert got["cudnn"] and got["gpu"] is False, got  # cuDNN loads; no GPU on this machine
    help_text = run_image(tmp_path, "--", "--help")
    assert help_text.returncode == 0 and "--config" in help_text.stdout, help_text.stderr[-2000:]
