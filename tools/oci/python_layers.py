"""Builds the images' Python dependency layers from requirements.lock (once per user and lock).

Run by the `kitchen_python_layers` repository rule with the toolchain venv's python (it uses
that venv's pip and `packaging`). A spec (images/python_layers.json) names the layers:

  {"prefix": "/opt/kitchen/site-packages",
   "layers": [{"name": "torch", "roots": ["torch", "numpy"]},
              {"name": "trainer_deps", "roots": ["grpcio", ...], "below": ["torch"]}]}

`--only` builds a subset (one image's layers), so the launcher's layers never wait for torch.
Each layer holds its roots and everything they require (markers evaluated for this
interpreter, which must match the image's Python minor version), minus what the layers in
`below` already hold. Every package is installed at its locked version with
`pip install --no-deps --target` (wheels only), byte-compiled with checked-hash .pyc files
(deterministic, with the image's paths as file names), split by each package's RECORD, and
written as a reproducible layer. Console scripts and their RECORD lines are left out: their
shebangs name the build machine's venv. Output: a cache directory, keyed by the lock, the spec, this
code and the interpreter, holding <layer>.tar.gz, <layer>.json (descriptor) and
<layer>.packages.txt; its path is the last line printed.
"""

import argparse
import concurrent.futures
import csv
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys

from packaging.requirements import Requirement

from tools.cache_dir import kitchen_cache_root
from tools.oci import layer_tar

STAMP = ".complete"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str) -> dict[str, str]:
    """{normalized name: 'Name==version'} from a fully pinned requirements file."""
    pins = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, _ = line.partition("==")
            if not sep:
                sys.exit(f"python layers: {path}:{lineno}: {line!r} is not pinned with ==")
            pins[normalize(name)] = line
    return pins


def cache_key(lock: bytes, spec: bytes, only: list[str]) -> str:
    h = hashlib.sha256()
    for part in (lock, spec, ",".join(only).encode()):
        h.update(hashlib.sha256(part).digest())
    for module in (__file__, layer_tar.__file__):
        with open(module, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    h.update(f"{platform.python_version()}-{platform.machine()}".encode())
    return h.hexdigest()[:16]


def pip_install(pins: list[str], target: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
    command += ["--only-binary=:all:", "--target", target, *pins]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.exit(f"python layers: pip could not install {' '.join(pins)}:\n{proc.stdout[-4000:]}")


def install_closure(roots: set[str], pins: dict[str, str], work: str) -> dict:
    """Installs roots and, round by round, what they require; returns {name: (dir, dist)}.

    Each round goes into its own directory so pip never has to merge into an existing target.
    """
    installed: dict[str, tuple[str, importlib.metadata.Distribution]] = {}
    wanted = set(roots)
    round_no = 0
    while wanted - installed.keys():
        todo = sorted(wanted - installed.keys())
        unpinned = [n for n in todo if n not in pins]
        if unpinned:
            sys.exit(f"python layers: requirements.lock does not pin {', '.join(unpinned)}")
        target = os.path.join(work, f"round{round_no}")
        sys.stderr.write(f"python layers: pip install {' '.join(pins[n] for n in todo)}\n")
        pip_install([pins[n] for n in todo], target)
        for dist in importlib.metadata.distributions(path=[target]):
            installed[normalize(dist.metadata["Name"])] = (target, dist)
        for name in todo:
            for requirement in installed[name][1].requires or []:
                req = Requirement(requirement)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    wanted.add(normalize(req.name))
        round_no += 1
    return installed


def closure(roots: list[str], installed: dict) -> set[str]:
    seen, stack = set(), [normalize(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in installed[name][1].requires or []:
            req = Requirement(requirement)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(normalize(req.name))
    return seen


def shipped(rel: str) -> bool:
    """Console scripts (bin/) stay out: their shebangs name this machine's venv."""
    rel = os.path.normpath(rel)
    return not (rel.startswith("..") or rel.startswith("bin" + os.sep))


def trimmed_record(path: str, out: str) -> str:
    """A copy of RECORD without the scripts left out, whose hashes cover the venv's path."""
    with open(path, newline="") as f:
        lines = [line for line in f if shipped(next(csv.reader([line]))[0])]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", newline="") as f:
        f.writelines(lines)
    return out


def dist_entries(site: str, dist, prefix: str, scratch: str) -> list[layer_tar.Entry]:
    """The files pip recorded for one package, plus the .pyc compiled next to each module."""
    entries = []
    for record in dist.files or []:
        rel = os.path.normpath(str(record))
        if not shipped(rel):
            continue
        source = os.path.join(site, rel)
        if not os.path.exists(source):
            continue
        if rel.endswith(".dist-info" + os.sep + "RECORD"):
            source = trimmed_record(source, os.path.join(scratch, rel))
        entries.append(layer_tar.Entry(os.path.join(prefix, rel), source=source))
        if rel.endswith(".py"):
            pyc = importlib.util.cache_from_source(source)
            if os.path.exists(pyc):
                pyc_rel = os.path.relpath(pyc, site)
                entries.append(layer_tar.Entry(os.path.join(prefix, pyc_rel), source=pyc))
    return entries


def write_one_layer(name: str, entries: list, out_dir: str, level: int) -> tuple[str, dict]:
    descriptor = layer_tar.write_layer(entries, os.path.join(out_dir, f"{name}.tar.gz"), level)
    return name, descriptor


def build(spec: dict, pins: dict[str, str], only: list[str], out: str) -> None:
    python_minor = ".".join(platform.python_version_tuple()[:2])
    if spec.get("python") and spec["python"] != python_minor:
        sys.exit(
            f"python layers: the spec targets Python {spec['python']} but the build interpreter "
            f"is {python_minor}; .pyc files and wheel tags would not match the image"
        )
    prefix = spec["prefix"]
    layers = {layer["name"]: layer for layer in spec["layers"]}
    unknown = [name for name in only if name not in layers]
    if unknown:
        sys.exit(f"python layers: no layer named {', '.join(unknown)} in the spec")
    for name, layer in layers.items():
        for lower in layer.get("below", []):
            if lower not in layers:
                sys.exit(f"python layers: layer {name!r} is below unknown layer {lower!r}")
    wanted = only or list(layers)
    # Layers below a wanted one are needed to know what to leave out of it.
    needed = set(wanted) | {lower for name in wanted for lower in layers[name].get("below", [])}
    work = os.path.join(out, "work")
    roots = {normalize(r) for name in needed for r in layers[name]["roots"]}
    installed = install_closure(roots, pins, work)

    sys.stderr.write("python layers: byte-compiling (checked-hash .pyc)\n")
    for site in sorted({site for site, _ in installed.values()}):
        # Exit status 1 only means some file did not compile (e.g. test data in Python 2).
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-q", "-j", "0", "-d", prefix]
            + ["--invalidation-mode", "checked-hash", site],
            check=False,
        )

    contents: dict[str, list[str]] = {}
    jobs = {}
    for name in wanted:
        layer = layers[name]
        below = set()
        for lower in layer.get("below", []):
            below |= closure(layers[lower]["roots"], installed)
        packages = sorted(closure(layer["roots"], installed) - below)
        contents[name] = [pins[p] for p in packages]
        entries = []
        for package in packages:
            site, dist = installed[package]
            entries += dist_entries(site, dist, prefix, os.path.join(work, "records"))
        jobs[name] = entries

    sys.stderr.write(f"python layers: writing {len(jobs)} layers (gzip, ~1 min for torch)\n")
    level = spec.get("compression_level", layer_tar.DEFAULT_GZIP_LEVEL)
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(write_one_layer, n, e, out, level) for n, e in jobs.items()]
        for future in concurrent.futures.as_completed(futures):
            name, descriptor = future.result()
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(descriptor, f, sort_keys=True, indent=1)
            with open(os.path.join(out, f"{name}.packages.txt"), "w") as f:
                f.write("".join(line + "\n" for line in contents[name]))
    shutil.rmtree(work)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lock", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--only", nargs="*", default=[], help="layer names to build (default all)")
    parser.add_argument("--out", help="output directory (default: the per-user cache)")
    args = parser.parse_args()
    with open(args.lock, "rb") as f:
        lock_bytes = f.read()
    with open(args.spec, "rb") as f:
        spec_bytes = f.read()
    try:
        spec = json.loads(spec_bytes)
    except json.JSONDecodeError as e:
        sys.exit(f"python layers: {args.spec}: invalid JSON: {e}")
    pins = read_lock(args.lock)
    out = args.out or os.path.join(
        kitchen_cache_root(), "oci", "python-layers", cache_key(lock_bytes, spec_bytes, args.only)
    )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)  # two clones fetching at once build it once
        if not os.path.exists(os.path.join(out, STAMP)):
            if os.path.exists(out):
                shutil.rmtree(out)  # left by an interrupted run
            os.makedirs(out)
            build(spec, pins, args.only, out)
            with open(os.path.join(out, STAMP), "w") as f:
                f.write(args.lock + "\n")
    print(out)


if __name__ == "__main__":
    main()
