"""run_image.py runs a real image (Debian base + a test job) with bwrap and with runc."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.oci import testing

# Set by the Bazel target: //tools/oci:testdata_image (Debian base + testdata/job.py).
LAYOUT = os.environ.get("RUN_IMAGE_TEST_LAYOUT", "")
RUNTIMES = ["bwrap", "runc"]


@pytest.fixture(scope="module", autouse=True)
def image_layout():
    assert LAYOUT and os.path.isdir(LAYOUT), "RUN_IMAGE_TEST_LAYOUT must name the test image"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rootfs-cache")


def run_image(cache_dir, *args, runtime="bwrap", popen=False):
    command = [sys.executable, "-m", "tools.oci.run_image", "--layout", LAYOUT]
    command += ["--cache-dir", str(cache_dir), "--runtime", runtime, *args]
    env = dict(os.environ, PYTHONPATH=testing.pythonpath())
    if popen:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_job_sees_the_image_and_its_run_dir(cache_dir, tmp_path, runtime):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = run_image(
        cache_dir,
        "--bind",
        str(run_dir),
        "--env",
        "EXTRA=1",
        "--",
        str(run_dir),
        "report",
        runtime=runtime,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["python"] == [3, 11]
    assert "bookworm" in report["os_release"]
    assert report["cwd"] == "/opt/test"
    assert report["env"]["JOB_KIND"] == "test", "Env from the image config"
    assert report["env"]["EXTRA"] == "1", "--env adds to it"
    assert report["root_writable"] is False, "the shared unpacked rootfs must stay read-only"
    assert report["tmp_writable"] is True
    assert not (cache_dir / "written-by-job").exists()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_exit_status_is_the_commands(cache_dir, tmp_path, runtime):
    proc = run_image(cache_dir, "--", str(tmp_path), "exit:3", runtime=runtime)
    assert proc.returncode == 3, proc.stderr


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sigterm_reaches_the_job_which_exits_75(cache_dir, tmp_path, runtime):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = run_image(
        cache_dir, "--bind", str(run_dir), "--", str(run_dir), "wait", runtime=runtime, popen=True
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    assert (run_dir / "preempted").read_text() == "SIGTERM"


def test_unpacks_once_per_image(cache_dir, tmp_path):
    first = run_image(cache_dir, "--", str(tmp_path), "exit:0")
    second = run_image(cache_dir, "--", str(tmp_path), "exit:0")
    assert first.returncode == second.returncode == 0
    assert "unpacking" not in second.stderr
    rootfs = run_image(cache_dir, "--unpack-only").stdout.strip()
    assert Path(rootfs).is_relative_to(cache_dir) and (Path(rootfs) / "usr/bin/python3").exists()


def test_entrypoint_can_be_replaced(cache_dir):
    proc = run_image(
        cache_dir, "--entrypoint", "python3 -c 'import sys; print(sys.argv[1:])'", "--", "a", "b"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['a', 'b']"


def test_missing_bind_source_is_named(cache_dir, tmp_path):
    proc = run_image(cache_dir, "--bind", str(tmp_path / "nope"), "--", "x", "exit:0")
    assert proc.returncode != 0
    assert f"{tmp_path / 'nope'} does not exist" in proc.stderr


def test_image_from_a_registry_by_digest(cache_dir, tmp_path):
    with testing.local_registry(tmp_path / "registry") as registry:
        pushed = testing.run_module(
            "tools.oci.push",
            "--layout",
            LAYOUT,
            "--repository",
            "kitchen/job",
            "--registry",
            registry,
        )
        reference = pushed.stdout.strip().splitlines()[-1]
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        command = [sys.executable, "-m", "tools.oci.run_image", "--image", reference]
        command += [
            "--cache-dir",
            str(cache_dir),
            "--bind",
            str(run_dir),
            "--",
            str(run_dir),
            "report",
        ]
        env = dict(os.environ, PYTHONPATH=testing.pythonpath())
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run_dir / "report.json").read_text())["env"]["JOB_KIND"] == "test"


def test_runs_as_a_plain_file_outside_bazel(cache_dir, tmp_path):
    """The launcher calls `python3 tools/oci/run_image.py`: no PYTHONPATH needed."""
    script = Path(testing.REPO_ROOT) / "tools" / "oci" / "run_image.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--layout",
            LAYOUT,
            "--cache-dir",
            str(cache_dir),
            "--",
            "x",
            "exit:7",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 7, proc.stderr


def fake_driver(root: Path) -> tuple[Path, Path]:
    """A /dev with two GPUs and a driver library directory, as files: no GPU needed."""
    dev, lib = root / "dev", root / "lib"
    dev.mkdir()
    lib.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_text(name)
    (lib / "libcuda.so.550.54").write_text("driver")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.550.54")
    (lib / "libnvidia-ml.so.550.54").write_text("nvml")
    (lib / "libunrelated.so").write_text("not the driver's")
    return dev, lib


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_gpus_bring_their_device_nodes_and_the_hosts_driver(cache_dir, tmp_path, runtime):
    dev, lib = fake_driver(tmp_path)
    probe = (
        "import os, sys; d, l = sys.argv[1:]; print(sorted(os.listdir(d)), sorted(os.listdir(l)),"
        " os.environ.get('LD_LIBRARY_PATH'), os.environ.get('CUDA_VISIBLE_DEVICES'),"
        " os.environ.get('NVIDIA_VISIBLE_DEVICES'), open(l + '/libcuda.so.1').read())"
    )
    proc = run_image(
        cache_dir, "--gpus", "1", "--gpu-dev-root", str(dev), "--gpu-lib-dir", str(lib),
        "--env", "CUDA_VISIBLE_DEVICES=1", "--entrypoint", f"python3 -c {probe!r}",
        "--", str(dev), "/usr/local/nvidia/lib64", runtime=runtime,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # GPU 1 and the control nodes, not GPU 0; the driver's libraries, not the unrelated one;
    # the host's CUDA_VISIBLE_DEVICES (host indices) stays outside.
    assert proc.stdout.strip() == (
        "['nvidia-uvm', 'nvidia1', 'nvidiactl'] "
        "['libcuda.so.1', 'libcuda.so.550.54', 'libnvidia-ml.so.550.54'] "
        "/usr/local/nvidia/lib64 None 1 driver"
    )


def test_a_gpu_the_host_lacks_is_named(cache_dir, tmp_path):
    dev, lib = fake_driver(tmp_path)
    proc = run_image(
        cache_dir, "--gpus", "0,3", "--gpu-dev-root", str(dev), "--gpu-lib-dir", str(lib),
        "--", "x", "exit:0",
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"no {dev}/nvidia3 on this machine" in proc.stderr
