"""Runs a real Prometheus on 127.0.0.1 with Kitchen's committed config and rules, for tests.

The committed observability/prometheus/prometheus.yml is the starting point; only what a test
must change is changed: the scrape targets, a 1 s scrape and rule interval, absolute rule paths.
Usage:

    with running_prometheus(["127.0.0.1:9464"], tmp_path) as url:
        failures = check_queries_against(url, wait_s=30)
"""

import contextlib
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from observability.queries import PROMETHEUS_CONFIG

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_test_config(targets: list[str], workdir: Path, interval: str = "1s") -> Path:
    """Kitchen's prometheus.yml, scraping `targets` every `interval`; returns its path."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / path) for path in config["rule_files"]]
    (scrape,) = config["scrape_configs"]
    scrape["static_configs"] = [{"targets": list(targets)}]
    path = Path(workdir) / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"prometheus not ready after {timeout_s:.0f} s:\n{log.read_text()}")


@contextlib.contextmanager
def running_prometheus(
    targets: list[str], workdir: Path, *, interval: str = "1s", timeout_s: float = 30.0
) -> Iterator[str]:
    """Starts Prometheus (storage and log under `workdir`), yields its URL, stops it after."""
    workdir = Path(workdir)
    config = write_test_config(targets, workdir, interval)
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            [
                PROMETHEUS_BIN,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log, timeout_s)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
