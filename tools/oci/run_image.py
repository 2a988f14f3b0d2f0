"""Runs a command inside an OCI image, without a container daemon.

    run_image.py (--layout DIR | --image HOST/NAME[:TAG|@sha256:...]) [--runtime bwrap|runc]
                 [--bind SRC[:DST]]... [--env K=V]... [--workdir DIR] [--entrypoint CMD]
                 [--gpus 0,1|all] [--nproc-per-node N] [--cache-dir DIR] [--unpack-only]
                 [-- ARGS...]

--image pulls from a registry with skopeo into CACHE/pulled/ first (plain HTTP for
loopback registries); a digest reference is checked against the pulled manifest. The image
is unpacked once (`umoci unpack`) into CACHE/<manifest digest>/ and shared by every
run; runs see that rootfs read-only, with a fresh /tmp, the host's network (so a launcher on
127.0.0.1 is reachable) and the given bind mounts, writable (DST defaults to SRC, so paths in
ARGS stay valid). Entrypoint, Cmd, Env and WorkingDir come from the image config, as with
`docker run`: ARGS replace Cmd, --entrypoint replaces Entrypoint.

--gpus passes GPUs in: their device nodes and the host driver's libraries (tools/oci/gpus.py).

Exit status is the command's. SIGTERM/SIGINT/SIGHUP sent to this process are forwarded to the
command (runc forwards them itself; for bwrap they go to the sandboxed process), so a
preempted trainer can checkpoint and exit 75.
"""

import argparse
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

if not __package__:  # run as a file (python3 tools/oci/run_image.py): find the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.cache_dir import kitchen_cache_root  # noqa: E402
from tools.oci import gpus  # noqa: E402
from tools.oci import layout as oci  # noqa: E402

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def ref_name(layout: str, digest: str) -> str:
    with open(os.path.join(layout, "index.json")) as f:
        for desc in json.load(f).get("manifests", []):
            if desc["digest"] == digest and oci.REF_NAME in desc.get("annotations", {}):
                return desc["annotations"][oci.REF_NAME]
    raise SystemExit(f"run_image: {layout}: the image has no {oci.REF_NAME} annotation for umoci")


def unpack(layout: str, digest: str, cache_dir: str) -> str:
    """Returns the bundle directory (rootfs/ + umoci's config.json), unpacking it once."""
    bundle = os.path.join(cache_dir, digest.split(":", 1)[1])
    if os.path.exists(os.path.join(bundle, "config.json")):
        return bundle
    os.makedirs(cache_dir, exist_ok=True)
    with open(bundle + ".lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)  # concurrent jobs of one image unpack it once
        if os.path.exists(os.path.join(bundle, "config.json")):
            return bundle
        tmp = tempfile.mkdtemp(prefix=".unpack-", dir=cache_dir)
        staging = os.path.join(tmp, "bundle")
        command = ["umoci", "unpack", "--image", f"{layout}:{ref_name(layout, digest)}", staging]
        if os.geteuid() != 0:
            command.insert(2, "--rootless")
        sys.stderr.write(f"run_image: unpacking {digest[:19]} into {bundle} (once per image)\n")
        try:
            proc = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError:
            shutil.rmtree(tmp)
            raise SystemExit("run_image: umoci is not installed (apt-get install umoci)") from None
        if proc.returncode != 0:
            shutil.rmtree(tmp)
            raise SystemExit(f"run_image: umoci unpack failed:\n{proc.stderr.strip()}")
        os.replace(staging, bundle)
        os.rmdir(tmp)
    return bundle


def pull(reference: str, cache_dir: str) -> str:
    """Copies a registry image into an OCI layout under the cache; returns the layout."""
    layout = os.path.join(cache_dir, "pulled", hashlib.sha256(reference.encode()).hexdigest()[:16])
    os.makedirs(os.path.dirname(layout), exist_ok=True)
    tls = "false" if reference.startswith(("127.", "localhost", "[::1]")) else "true"
    with open(layout + ".lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)
        command = ["skopeo", "copy", "--quiet", "--preserve-digests", f"--src-tls-verify={tls}"]
        command += [f"docker://{reference}", f"oci:{layout}:{oci.DEFAULT_TAG}"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError:
            raise SystemExit(
                "run_image: skopeo is not installed (apt-get install skopeo)"
            ) from None
        if proc.returncode != 0:
            raise SystemExit(f"run_image: could not pull {reference}:\n{proc.stderr.strip()}")
    return layout


def parse_bind(spec: str) -> tuple[str, str]:
    src, _, dst = spec.partition(":")
    src = os.path.abspath(src)
    dst = dst or src
    if not os.path.exists(src):
        raise SystemExit(f"run_image: --bind {spec}: {src} does not exist")
    if not dst.startswith("/"):
        raise SystemExit(f"run_image: --bind {spec}: the path in the image must be absolute")
    return src, dst


def process_spec(config: dict, args) -> tuple[list[str], dict[str, str], str]:
    runtime = config.get("config") or {}
    entrypoint = (
        shlex.split(args.entrypoint)
        if args.entrypoint is not None
        else runtime.get("Entrypoint") or []
    )
    command = entrypoint + (args.args if args.args else runtime.get("Cmd") or [])
    if not command:
        raise SystemExit("run_image: the image has no Entrypoint or Cmd; give a command after --")
    env = dict(item.split("=", 1) for item in runtime.get("Env", []))
    env.setdefault("HOME", "/tmp")  # the rootfs is read-only; /tmp is a fresh tmpfs
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"run_image: --env {item!r} is not KEY=VALUE")
        env[key] = value
    workdir = args.workdir or runtime.get("WorkingDir") or "/"
    return command, env, workdir


def ensure_mount_points(rootfs: str, binds: list[tuple[str, str]]) -> None:
    """Mount points must exist in the read-only rootfs; empty directories are added to it."""
    for src, dst in binds:
        if dst == "/tmp" or dst.startswith("/tmp/"):
            continue  # /tmp is a tmpfs in which the runtime creates them
        target = os.path.join(rootfs, dst.lstrip("/"))
        if os.path.isdir(src):
            os.makedirs(target, exist_ok=True)
        elif not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()


def bwrap_command(
    rootfs: str, command, env, workdir, binds, info_fd: int, gpu: gpus.GpuMounts | None = None
) -> list[str]:
    argv = ["bwrap", "--ro-bind", rootfs, "/", "--proc", "/proc", "--dev", "/dev"]
    argv += [
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/dev/shm",
        "--die-with-parent",
        "--info-fd",
        str(info_fd),
    ]
    for src, dst in binds:
        argv += ["--bind", src, dst]
    if gpu:
        argv += gpus.bwrap_args(gpu)
    argv += ["--chdir", workdir, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv + ["--", *command]


def runc_bundle(
    bundle: str, command, env, workdir, binds, run_dir: str, gpu: gpus.GpuMounts | None = None
) -> None:
    """A per-run runc bundle: umoci's config with our process, read-only root, host network."""
    with open(os.path.join(bundle, "config.json")) as f:
        spec = json.load(f)
    spec["root"] = {"path": os.path.join(bundle, "rootfs"), "readonly": True}
    spec["process"].update(
        terminal=False, args=command, env=[f"{k}={v}" for k, v in env.items()], cwd=workdir
    )
    spec["linux"]["namespaces"] = [
        ns for ns in spec["linux"]["namespaces"] if ns["type"] != "network"
    ]
    mounts = [m for m in spec["mounts"] if m["destination"] != "/tmp"]
    mounts.append(
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]}
    )
    for src, dst in binds:
        mounts.append(
            {"destination": dst, "type": "bind", "source": src, "options": ["rbind", "rw"]}
        )
    spec["mounts"] = mounts
    if gpu:
        gpus.runc_spec(spec, gpu)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(spec, f)


def run(args) -> int:
    if args.image:
        layout = pull(args.image, args.cache_dir)
        wanted = args.image.partition("@")[2] or None
        digest, _, config = oci.read_image(layout, wanted)
    else:
        layout = os.path.realpath(args.layout)
        digest, _, config = oci.read_image(layout)
    bundle = unpack(layout, digest, args.cache_dir)
    rootfs = os.path.join(bundle, "rootfs")
    if args.unpack_only:
        print(rootfs)
        return 0
    command, env, workdir = process_spec(config, args)
    if args.nproc_per_node > 1:  # several processes of the entrypoint, as torchrun starts them
        command = [
            "python3", "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={args.nproc_per_node}", "--no-python", *command,
        ]  # fmt: skip
    binds = [parse_bind(b) for b in args.bind]
    ensure_mount_points(rootfs, binds)
    gpu = None
    if args.gpus:
        dev_root = args.gpu_dev_root or "/dev"
        chosen = gpus.parse_gpus(args.gpus, dev_root)
        gpu = gpus.gpu_mounts(chosen, dev_root, args.gpu_lib_dir or None)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # host indices; inside, the GPUs are 0..k-1
        env.update(gpu.env)
        ensure_mount_points(rootfs, [(d.path, d.path) for d in gpu.devices])
        ensure_mount_points(rootfs, list(gpu.libraries))

    # Signals that arrive before the command is known are delivered once it is.
    target: dict[str, int | None] = {"pid": None}
    pending: list[int] = []

    def forward(signum, _frame):
        if target["pid"] is None:
            pending.append(signum)
            return
        try:
            os.kill(target["pid"], signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)

    run_dir = None
    if args.runtime == "bwrap":
        info_read, info_write = os.pipe()
        argv = bwrap_command(rootfs, command, env, workdir, binds, info_write, gpu)
        proc = subprocess.Popen(argv, pass_fds=[info_write], start_new_session=True)
        os.close(info_write)
        with os.fdopen(info_read) as info:
            text = info.read()
        # bwrap does not pass signals on: they go to the sandboxed process itself.
        target["pid"] = json.loads(text)["child-pid"] if text.strip() else proc.pid
    else:
        run_dir = tempfile.mkdtemp(prefix="kitchen-runc-")
        runc_bundle(bundle, command, env, workdir, binds, run_dir, gpu)
        container = f"kitchen-{uuid.uuid4().hex[:12]}"
        argv = [
            "runc",
            "--root",
            os.path.join(args.cache_dir, ".runc"),
            "run",
            "--bundle",
            run_dir,
            container,
        ]
        proc = subprocess.Popen(argv, start_new_session=True)
        target["pid"] = proc.pid  # runc forwards signals to the container's process
    for early in pending:
        forward(early, None)
    try:
        return proc.wait()
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--layout", help="OCI image layout directory")
    source.add_argument(
        "--image", help="registry reference, e.g. 127.0.0.1:5000/kitchen/trainer@sha256:..."
    )
    parser.add_argument("--runtime", choices=["bwrap", "runc"], default="bwrap")
    parser.add_argument(
        "--bind", action="append", default=[], metavar="SRC[:DST]", help="writable bind mount"
    )
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workdir", help="working directory in the image (default: the image's)")
    parser.add_argument(
        "--entrypoint", help="replaces the image's Entrypoint (shell-quoted string)"
    )
    parser.add_argument(
        "--cache-dir",
        default=os.path.join(kitchen_cache_root(), "oci", "rootfs"),
        help="where unpacked images live",
    )
    parser.add_argument(
        "--unpack-only", action="store_true", help="unpack, print the rootfs path, exit"
    )
    parser.add_argument(
        "--gpus", help="GPUs to pass in: host indices (0,1) or 'all' (tools/oci/gpus.py)"
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="run the command under torchrun in N processes (the image needs torch)",
    )
    # Where the driver is: the host's /dev and ldconfig, unless a test points at a fake one.
    parser.add_argument("--gpu-dev-root", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-lib-dir", action="append", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help="replaces the image's Cmd (put them after --)")
    args = parser.parse_args()
    code = run(args)
    # A command killed by signal N reports -N here; shells report 128+N.
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
