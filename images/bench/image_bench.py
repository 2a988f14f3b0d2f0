"""Image build and push benchmark: cold builds, one-line-change rebuilds, bytes pushed.

    python3 images/bench/image_bench.py [--out images/bench/results.md]
    python3 images/bench/image_bench.py --images trainer_cuda --skip-cold \
        --out images/bench/results_cuda.md      # the CUDA image: phases 2 and 3 only

Works on a fresh clone of the committed HEAD in a temporary directory, each phase with its own
Bazel output base, so nothing of this checkout's caches leaks into a "cold" figure:
  1. cold build of each image: an empty per-user image cache (mmdebstrap, pip, .pyc, gzip)
     and an empty Bazel output base; only the toolchain venv is shared (it is not an image
     input, and rebuilding it would time pip, not the images);
  2. rebuild with a warm per-user cache in a new output base (what `bazel clean --expunge`
     or a second clone costs), whose digests must equal the cold build's: an independent
     rebuild from scratch gives the same image;
  3. a one-line change to trainer/main.py (launcher/server.py): rebuild time, which layers
     changed, and what `bazel run //images:push_* -- --registry` then uploads to a real
     registry (docker-registry on 127.0.0.1) that holds the previous image.
Prints a Markdown report and writes it (with the machine and date) to --out. `--skip-cold`
leaves out phase 1 (for the CUDA image, a cold build would reinstall and recompress 3 GB of
NVIDIA wheels into a second per-user cache).
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.oci import layout as oci  # noqa: E402
from tools.oci import testing  # noqa: E402
from tools.oci.push import human_bytes  # noqa: E402

IMAGES = {
    "trainer": "trainer/main.py",
    "launcher": "launcher/server.py",
    "trainer_cuda": "trainer/main.py",
}
ONE_LINE = "# image bench: a one-line app change\n"


def user_cache() -> Path:
    if os.environ.get("KITCHEN_CACHE_DIR"):
        return Path(os.environ["KITCHEN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kitchen"


class Workspace:
    """A clone with one Bazel output base and one per-user Kitchen cache."""

    def __init__(self, clone: Path, output_base: Path, cache: Path | None):
        self.clone, self.output_base, self.cache = clone, output_base, cache

    def bazel(self, *args: str) -> tuple[float, str]:
        env = dict(os.environ)
        if self.cache is not None:
            env["KITCHEN_CACHE_DIR"] = str(self.cache)
        start = time.monotonic()
        proc = subprocess.run(
            ["./bazel", f"--output_base={self.output_base}", *args],
            cwd=self.clone,
            env=env,
            capture_output=True,
            text=True,
        )
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            sys.exit(f"bench: bazel {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
        return elapsed, proc.stdout

    def layout(self, image: str) -> str:
        return str(self.clone / ".bazel" / "bin" / "images" / f"{image}.oci")

    def image(self, image: str) -> tuple[str, list[str], int]:
        digest, manifest, _ = oci.read_image(self.layout(image))
        layers = [layer["digest"] for layer in manifest["layers"]]
        size = manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])
        return digest, layers, size

    def shutdown(self) -> None:
        subprocess.run(["./bazel", f"--output_base={self.output_base}", "shutdown"], cwd=self.clone)


def fresh_cache(path: Path) -> Path:
    """An empty image cache that still shares this user's toolchain venvs."""
    path.mkdir(parents=True)
    (path / "venvs").symlink_to(user_cache() / "venvs")
    return path


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({model}), {mem:.0f} GiB RAM, {platform.platform()}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(REPO / "images" / "bench" / "results.md"))
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--images", nargs="+", choices=sorted(IMAGES), default=["trainer", "launcher"]
    )
    parser.add_argument("--skip-cold", action="store_true", help="no cold builds (phase 1)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kitchen-image-bench-"))
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True
    ).stdout.strip()
    rows, notes = [], []

    cold = {}
    for image in [] if args.skip_cold else args.images:
        ws = Workspace(clone, tmp / f"ob-cold-{image}", fresh_cache(tmp / f"cache-{image}"))
        seconds, _ = ws.bazel("build", f"//images:{image}")
        cold[image] = ws.image(image)
        rows.append(
            (f"cold build //images:{image}", f"{seconds:.0f} s", human_bytes(cold[image][2]))
        )
        print(rows[-1], flush=True)
        ws.shutdown()

    warm = Workspace(clone, tmp / "ob-warm", None)  # this user's real image cache
    for image in args.images:
        seconds, _ = warm.bazel("build", f"//images:{image}")
        rows.append((f"new output base, warm user cache //images:{image}", f"{seconds:.1f} s", ""))
        print(rows[-1], flush=True)
        if image not in cold:
            continue
        same = warm.image(image)[0] == cold[image][0]
        notes.append(
            f"{image}: independent cold rebuild digest {cold[image][0]} "
            f"{'==' if same else '!='} warm-cache build digest {warm.image(image)[0]}"
        )
        print(notes[-1], flush=True)

    with testing.local_registry(tmp / "registry") as registry:
        for image in args.images:
            app_file = IMAGES[image]
            report = tmp / f"push-{image}.json"
            push_args = [
                "run",
                f"//images:push_{image}",
                "--",
                "--registry",
                registry,
                "--report",
                str(report),
            ]
            seconds, _ = warm.bazel(*push_args)
            first = json.loads(report.read_text())
            rows.append(
                (f"first push {image}", f"{seconds:.1f} s", human_bytes(first["upload_bytes"]))
            )
            print(rows[-1], flush=True)

            before = warm.image(image)
            with open(clone / app_file, "a") as f:
                f.write(ONE_LINE)
            seconds, _ = warm.bazel("build", f"//images:{image}")
            after = warm.image(image)
            changed = [
                i for i, (a, b) in enumerate(zip(before[1], after[1], strict=True)) if a != b
            ]
            rows.append((f"rebuild after one-line change in {app_file}", f"{seconds:.1f} s", ""))
            notes.append(
                f"{image}: layers changed by the one-line change: {changed} of {len(after[1])} "
                f"(the app layer is index {len(after[1]) - 1})"
            )
            print(rows[-1], notes[-1], flush=True)

            seconds, _ = warm.bazel(*push_args)
            second = json.loads(report.read_text())
            share = 100.0 * second["upload_bytes"] / second["image_bytes"]
            sent, total = human_bytes(second["upload_bytes"]), human_bytes(second["image_bytes"])
            rows.append(
                (
                    f"push after the change ({image})",
                    f"{seconds:.1f} s",
                    f"{sent} of {total} = {share:.3f}% of the image "
                    f"({second['upload_blobs']} blobs)",
                )
            )
            print(rows[-1], flush=True)
    warm.shutdown()

    lines = [
        "# Image build and push benchmark",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- machine: {machine()} (shared with other jobs while measured)",
        f"- commit: {commit}",
        f"- command: `{' '.join(['python3 images/bench/image_bench.py', *sys.argv[1:]])}`",
        "",
        "| what | time | bytes |",
        "|---|---|---|",
        *[f"| {what} | {t} | {b} |" for what, t, b in rows],
        "",
        *[f"- {note}" for note in notes],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
