"""GPUs inside a container that run_image.py starts: device nodes and the host's driver libraries.

An image carries the CUDA user space it was built with (torch's wheels bring the CUDA runtime,
cuBLAS, cuDNN and NCCL), but not the driver: `libcuda.so` and its companions must be the exact
version of the kernel module on the host, so they come from the host at run time, as the NVIDIA
Container Toolkit does it:
  - the chosen GPUs' device nodes (`/dev/nvidiaN`) and the control nodes every CUDA process
    opens (`/dev/nvidiactl`, `/dev/nvidia-uvm`, ...) are bound at their own paths; only the
    chosen GPUs exist inside, so CUDA numbers them 0..k-1 there and the host's
    CUDA_VISIBLE_DEVICES (host indices) must not follow the process in;
  - the driver's user-space libraries, found where the host's dynamic linker finds them, are
    bound read-only into LIB_DIR, which LD_LIBRARY_PATH puts first.
Everything is looked up under `dev_root` and `lib_dirs` so that tests can point at a fake
driver: no GPU is needed to check the mounts.
"""

import dataclasses
import glob
import os
import stat
import subprocess

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# The driver's user space a CUDA (and NVML) process loads; the names are the driver's own.
DRIVER_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
)
LIB_DIR = "/usr/local/nvidia/lib64"


@dataclasses.dataclass(frozen=True)
class Device:
    path: str  # the host's device node, bound at the same path
    major: int  # 0, 0 for something that is not a character device (a test's fake)
    minor: int


@dataclasses.dataclass(frozen=True)
class GpuMounts:
    devices: tuple[Device, ...]
    libraries: tuple[tuple[str, str], ...]  # (host file, path in the container), read-only
    env: dict[str, str]


def parse_gpus(spec: str, dev_root: str = "/dev") -> list[int]:
    """`0,2` -> [0, 2]; `all` -> every /dev/nvidiaN on the host. SystemExit names a bad one."""
    if spec == "all":
        found = sorted(
            int(name[len("nvidia") :])
            for name in os.listdir(dev_root)
            if name.startswith("nvidia") and name[len("nvidia") :].isdigit()
        )
        if not found:
            raise SystemExit(f"run_image: --gpus all: no {dev_root}/nvidiaN on this machine")
        return found
    try:
        gpus = [int(g) for g in spec.split(",")]
    except ValueError:
        raise SystemExit(f"run_image: --gpus {spec!r}: give GPU indices (0,1) or 'all'") from None
    if any(g < 0 for g in gpus):
        raise SystemExit(f"run_image: --gpus {spec!r}: indices are >= 0")
    return gpus


def _device(path: str) -> Device:
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        return Device(path, os.major(st.st_rdev), os.minor(st.st_rdev))
    return Device(path, 0, 0)


def host_library_dirs() -> list[str]:
    """Where the host's dynamic linker finds libcuda.so (ldconfig's cache), else the usual."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        out = ""
    dirs = [
        line.rsplit("=> ", 1)[1].rsplit("/", 1)[0]
        for line in out.splitlines()
        if "libcuda.so" in line and "=> " in line
    ]
    return list(dict.fromkeys(dirs)) or ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"]


def gpu_mounts(
    gpus: list[int], dev_root: str = "/dev", lib_dirs: list[str] | None = None
) -> GpuMounts:
    """What a container needs to use `gpus` (host indices). SystemExit if the host lacks one."""
    missing = [g for g in gpus if not os.path.exists(os.path.join(dev_root, f"nvidia{g}"))]
    if missing:
        raise SystemExit(
            f"run_image: --gpus: no {', '.join(f'{dev_root}/nvidia{g}' for g in missing)} on "
            "this machine (is the NVIDIA driver loaded?)"
        )
    libraries = []
    for lib_dir in lib_dirs if lib_dirs is not None else host_library_dirs():
        for name in DRIVER_LIBRARIES:
            for path in sorted(glob.glob(os.path.join(lib_dir, name + "*"))):
                libraries.append(
                    (os.path.realpath(path), os.path.join(LIB_DIR, os.path.basename(path)))
                )
    if not any(os.path.basename(dst).startswith("libcuda.so") for _, dst in libraries):
        raise SystemExit(
            "run_image: --gpus: no libcuda.so on this machine (the NVIDIA driver's library)"
        )
    env = {"LD_LIBRARY_PATH": LIB_DIR, "NVIDIA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    return GpuMounts(device_nodes(gpus, dev_root), tuple(dict.fromkeys(libraries)), env)


def device_nodes(gpus: list[int], dev_root: str = "/dev") -> tuple[Device, ...]:
    """The device nodes a process using `gpus` (host indices) opens: theirs and the control
    nodes this host has."""
    nodes = [os.path.join(dev_root, f"nvidia{g}") for g in gpus]
    nodes += [p for p in (os.path.join(dev_root, n) for n in CONTROL_NODES) if os.path.exists(p)]
    return tuple(_device(n) for n in nodes)


def bwrap_args(mounts: GpuMounts) -> list[str]:
    argv = []
    for d in mounts.devices:
        argv += ["--dev-bind", d.path, d.path]
    for src, dst in mounts.libraries:
        argv += ["--ro-bind", src, dst]
    return argv


def runc_spec(spec: dict, mounts: GpuMounts) -> None:
    """Adds the devices (nodes, and cgroup rules that allow them) and the libraries to a runc
    config.json `spec`, in place."""
    linux = spec.setdefault("linux", {})
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    for d in mounts.devices:
        if d.major or d.minor:
            linux.setdefault("devices", []).append(
                {
                    "path": d.path,
                    "type": "c",
                    "major": d.major,
                    "minor": d.minor,
                    "fileMode": 0o666,
                    "uid": 0,
                    "gid": 0,
                }
            )
            rules.append(
                {"allow": True, "type": "c", "major": d.major, "minor": d.minor, "access": "rwm"}
            )
        else:  # not a character device (a test's stand-in): a plain bind
            spec["mounts"].append(
                {
                    "destination": d.path,
                    "type": "bind",
                    "source": d.path,
                    "options": ["rbind", "rw"],
                }
            )
    for src, dst in mounts.libraries:
        spec["mounts"].append(
            {"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro"]}
        )
