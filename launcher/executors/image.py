"""Jobs that name an image: local and Slurm pools run the trainer inside it (run_image.py);
Kubernetes pools hand it to the cluster, which pulls it (`check(..., pulled=True)`).

`JobSpec.image` is either an OCI image layout directory on the launcher's machine, as an
absolute path (e.g. `/work/main/.bazel/bin/images/trainer.oci`), or a registry reference
pinned by digest (`HOST/NAME@sha256:<64 hex>`), so every attempt runs the same bytes. The
image's Entrypoint is the trainer (the trainer contract: `--attempt <attempt_dir>/attempt.json`),
so the host's trainer_cmd is not used. The run dir (holding the attempt's handoff files, the
token among them), the precook cache and the TLS root certificate are bind-mounted at their own
paths, so the paths in attempt.json stay valid inside. No job fact and no secret travels in
run_image.py's argv or environment: `ps` on the host shows none.
"""

import os
import re

from launcher.executors.base import PORTABLE_ENV, Launch
from protos.config_yaml import ConfigError

DIGEST_REF = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def check(image: str, pulled: bool = False, field: str = "image"):
    """Raises a ConfigError naming `field` unless `image` is a digest reference or, where the
    launcher's machine runs it (`pulled` False: local and Slurm pools), a layout dir. A
    Kubernetes pool pulls from a registry: only a digest, never a tag such as `:latest`."""
    if pulled:
        if DIGEST_REF.match(image):
            return
        raise ConfigError(
            field,
            f"{image}: a Kubernetes pool pulls images from a registry: pin it by digest "
            "(HOST/NAME@sha256:<64 hex>), so every attempt runs the same bytes",
        )
    if image.startswith("/"):
        if not os.path.isfile(os.path.join(image, "index.json")):
            raise ConfigError(field, f"{image}: not an OCI image layout (no index.json)")
        return
    if DIGEST_REF.match(image):
        return
    if image.startswith(".") or os.path.isdir(image):
        raise ConfigError(field, f"{image}: give an image layout as an absolute path")
    raise ConfigError(
        field, f"{image}: a registry image must be pinned by digest (NAME@sha256:<64 hex>)"
    )


def command(cfg, launch: Launch, env: dict, gpus: str = "") -> list:
    """The run_image.py argv that runs this attempt's trainer in `launch.job.spec.image`.

    `cfg` is the resolved kitchen.v1.ImageRunConfig; `env` the trainer's environment; `gpus`
    the host's indices of the GPUs the attempt holds ("0,1"; "" for none), passed in with
    their device nodes and the host's driver (tools/oci/gpus.py). Several processes per node
    run under torchrun inside the image."""
    image = launch.job.spec.image
    argv = [*cfg.run_image_cmd, "--layout" if image.startswith("/") else "--image", image]
    argv += ["--runtime", cfg.runtime, "--cache-dir", cfg.cache_dir]
    attempt = launch.attempt
    run_dir = attempt.run_dir
    os.makedirs(attempt.cache_dir, exist_ok=True)  # a bind mount's source must exist
    binds = [run_dir, attempt.cache_dir]
    if attempt.tls_ca:
        binds.append(attempt.tls_ca)
    binds += cfg.binds
    inside = os.path.join(run_dir, "")
    for path in dict.fromkeys(binds):
        if path == run_dir or not path.startswith(inside):
            argv += ["--bind", path]
    argv += [f"--env={k}={env[k]}" for k in PORTABLE_ENV if k in env]
    if gpus:
        argv.append(f"--gpus={gpus}")
    nproc = launch.job.spec.resources.processes_per_node or 1
    if nproc > 1:
        argv.append(f"--nproc-per-node={nproc}")
    if cfg.entrypoint:
        argv += ["--entrypoint", cfg.entrypoint]
    return [*argv, "--", *launch.trainer_args()]
