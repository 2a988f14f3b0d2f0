"""Builds (once) the virtual environment that Kitchen's Python toolchain runs in.

Called by the `kitchen_venv` repository rule (venv.bzl); prints the venv's directory on its
last line. The venv lives in a per-user cache, keyed by the hash of requirements.lock and the
interpreter's version, so that:
  - an unchanged lock never reinstalls anything (a second clone, `bazel clean --expunge`);
  - a changed lock gets a new directory, hence a new interpreter path, hence new cache keys
    for every Python action and test;
  - the path does not depend on where the repository is checked out (remote cache hits).
A venv is complete only once its stamp file exists; a half-built one is removed and rebuilt.

The venv's bytecode is compiled once, after the install, because nothing else ever writes it:
Bazel's sandbox mounts the venv read-only, so without it every test process compiled torch's
sources again (~5 s of CPU per process that imports torch._dynamo, which torch.optim does; a
trainer run of 6 tiny steps went from 10.7 s to 3.9 s with the bytecode in place).
"""

import argparse
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys

from tools.cache_dir import kitchen_cache_root

MIN_PYTHON = (3, 11)
STAMP = ".kitchen-venv-complete"
COMPILED = ".kitchen-venv-compiled"  # a venv built before compile_bytecode existed lacks it


def venv_key(lock_bytes: bytes) -> str:
    h = hashlib.sha256(lock_bytes)
    h.update(f"{platform.python_version()}-{platform.machine()}".encode())
    return h.hexdigest()[:16]


def failing_package(pip_output: str) -> str:
    """Best guess at which requirement pip choked on, so the error names it."""
    patterns = [
        r"No matching distribution found for (\S+)",
        r"Could not find a version that satisfies the requirement (\S+)",
        r"Failed to build (\S+)",
        r"Failed building wheel for (\S+)",
        r"ERROR: Cannot install (\S+)",
        r"^(\S+) \S+ has requirement",  # pip check
    ]
    for pattern in patterns:
        match = re.search(pattern, pip_output, re.MULTILINE)
        if match:
            return match.group(1)
    return "(see pip's output above)"


def run_pip(python: str, args: list[str], lock: str) -> None:
    proc = subprocess.run(
        [python, "-m", "pip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:])
        sys.exit(
            f"kitchen venv: pip failed on package {failing_package(proc.stdout)} "
            f"while installing {lock} (pip {' '.join(args[:1])} exit {proc.returncode})"
        )


def build(venv: str, lock: str) -> None:
    if os.path.exists(venv):
        shutil.rmtree(venv)  # a half-built venv from an interrupted run
    sys.stderr.write(f"kitchen venv: creating {venv} from {lock} (first run only, ~1 min)\n")
    proc = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            f"kitchen venv: `{sys.executable} -m venv` failed: {proc.stderr.strip()}\n"
            "On Debian install python3-venv (./bazel does this when run as root)."
        )
    python = os.path.join(venv, "bin", "python3")
    # --no-deps: the lock already lists every transitive package at an exact version.
    run_pip(python, ["install", "--quiet", "--no-deps", "--no-compile", "-r", lock], lock)
    run_pip(python, ["check"], lock)
    write_stamp(os.path.join(venv, STAMP), lock)


def compile_bytecode(venv: str) -> None:
    """Every .py under the venv to __pycache__ (~100 s on 2 cores, once). Timestamp-checked, so
    an edited file in site-packages is recompiled, not served stale. compileall exits 1 when a
    file does not parse on this Python (torch ships py312-only test helpers): that is expected;
    anything else is an error."""
    sys.stderr.write(f"kitchen venv: compiling {venv}'s bytecode (once, ~2 min)\n")
    python = os.path.join(venv, "bin", "python3")
    command = [python, "-m", "compileall", "-q", "-q", "-j", "0"]
    command += ["--invalidation-mode", "timestamp", venv]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode not in (0, 1):
        tail = proc.stdout[-2000:]
        sys.exit(f"kitchen venv: compileall failed (exit {proc.returncode}):\n{tail}")
    write_stamp(os.path.join(venv, COMPILED), "compileall")


def write_stamp(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lock", required=True)
    args = parser.parse_args()
    if sys.version_info < MIN_PYTHON:
        sys.exit(
            f"kitchen venv: Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} is required, "
            f"but {sys.executable} is {platform.python_version()}"
        )
    with open(args.lock, "rb") as f:
        lock_bytes = f.read()
    root = os.path.join(kitchen_cache_root(), "venvs")
    os.makedirs(root, exist_ok=True)
    venv = os.path.join(root, venv_key(lock_bytes))
    with open(venv + ".lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)  # two clones fetching at once build it once
        if not os.path.exists(os.path.join(venv, STAMP)):
            build(venv, args.lock)
        if not os.path.exists(os.path.join(venv, COMPILED)):
            compile_bytecode(venv)
    print(venv)


if __name__ == "__main__":
    main()
