"""Test helpers: small images built with the rules' own scripts, and a real local registry."""

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tools.oci import layout as oci

REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]
MANIFEST_ACCEPT = ", ".join([oci.MANIFEST_MEDIA_TYPE, oci.INDEX_MEDIA_TYPE])


def pythonpath() -> str:
    """PYTHONPATH for subprocesses running tools.oci modules (in Bazel's runfiles or a checkout)."""
    here = str(REPO_ROOT)
    return os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH", "")] if p)


def run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        check=True,
        env=dict(env if env is not None else os.environ, PYTHONPATH=pythonpath()),
    )


@dataclasses.dataclass
class Layer:
    blob: Path
    descriptor_path: Path


@dataclasses.dataclass
class Image:
    layout: Path
    digest: str
    manifest: dict
    config: dict
    layers: list[Layer]


def write_app_layer(
    directory: Path, text: str, name: str = "app", prefix: str = "/opt/app"
) -> Layer:
    src = directory / "src" / name
    src.mkdir(parents=True, exist_ok=True)
    (src / "main.py").write_text(text)
    (src / "__init__.py").write_text("")
    blob, desc = directory / f"{name}.tar.gz", directory / f"{name}.json"
    files = [f"--file={name}/{f}={src / f}" for f in ("main.py", "__init__.py")]
    run_module(
        "tools.oci.write_layer",
        "--prefix",
        prefix,
        *files,
        "--out",
        str(blob),
        "--descriptor",
        str(desc),
    )
    return Layer(blob, desc)


def write_image(
    directory: Path, settings: dict, layers: list[Layer], status: Path | None = None
) -> Image:
    directory.mkdir(parents=True, exist_ok=True)
    settings_path = directory / "settings.json"
    settings_path.write_text(json.dumps(settings))
    args = ["--settings", str(settings_path), "--out", str(directory / "layout")]
    args += ["--config-out", str(directory / "config.json")]
    for layer in layers:
        args += ["--layer", str(layer.blob), str(layer.descriptor_path)]
    if status is not None:
        args += ["--status", str(status)]
    run_module("tools.oci.write_image", *args)
    digest, manifest, config = oci.read_image(str(directory / "layout"))
    return Image(directory / "layout", digest, manifest, config, layers)


def build_image(directory: Path, app_extra_line: str = "", status: Path | None = None) -> Image:
    """A two-layer image (a fixed 'dependency' layer and an app layer) with fixed settings."""
    directory.mkdir(parents=True, exist_ok=True)
    deps = write_app_layer(
        directory, "VERSION = '1.0'\n" + "# padding\n" * 2000, name="deps", prefix="/opt/site"
    )
    app = write_app_layer(directory, "print('hello from the app')\n" + app_extra_line)
    settings = {
        "base_config": None,
        "entrypoint": ["python3", "-m", "app.main"],
        "cmd": None,
        "env": {"PATH": "/usr/bin:/bin", "APP_MODE": "test"},
        "workdir": "/opt/app",
        "labels": {"org.opencontainers.image.revision": "{STABLE_GIT_COMMIT}"},
        "created_by": ["deps layer", "app layer"],
    }
    return write_image(directory, settings, [deps, app], status)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_registry(storage: Path):
    """A real registry (Debian's docker-registry) on 127.0.0.1; yields HOST:PORT."""
    port = free_port()
    storage.mkdir(parents=True, exist_ok=True)
    config = storage / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {storage / 'data'}}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
    )
    log = open(storage / "registry.log", "w")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2):
                    break
            except (urllib.error.URLError, OSError) as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_text = (storage / "registry.log").read_text()
                    raise RuntimeError(f"docker-registry did not start: {log_text}") from e
                time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def registry_manifest_digest(address: str, repository: str, reference: str) -> tuple[str, bytes]:
    """The digest the registry reports for a manifest (Docker-Content-Digest) and its bytes."""
    request = urllib.request.Request(
        f"http://{address}/v2/{repository}/manifests/{reference}",
        headers={"Accept": MANIFEST_ACCEPT},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.headers["Docker-Content-Digest"], response.read()
