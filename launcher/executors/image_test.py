"""Jobs that name an image: a real launcher (auth on) runs the fake trainer inside the real
launcher image (bwrap); it reads its attempt.json and token file from the bind-mounted run dir,
progress comes back over gRPC from inside, the token shows in no process's argv or
environment, cancel reaches it as SIGTERM; bad image values are refused at submit, naming the
field."""

import os
import shlex
from typing import Any

import grpc
import pytest

from launcher import settings, validation
from launcher.client import Client
from launcher.executors import handoff
from launcher.executors.base import Launch, attempt_dir
from launcher.executors.slurm import SlurmExecutor
from launcher.testdata import harness
from protos import job_pb2, launcher_pb2
from protos.config_yaml import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Under Bazel: //images:launcher (Python, grpc and the protos, no torch); else a built one.
LAYOUT = os.path.abspath(
    os.environ.get("LAUNCHER_LAYOUT") or os.path.join(REPO, ".bazel/bin/images/launcher.oci")
)
FAKE_TRAINER = os.path.realpath(harness.FAKE_TRAINER)
DIGEST = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # the image is unpacked once for this file


@pytest.fixture
def in_image(tmp_path, cache_dir):
    """A launcher whose local pool runs jobs naming an image in it, with the fake trainer."""
    if not os.path.isfile(os.path.join(LAYOUT, "index.json")):
        pytest.skip(f"{LAYOUT} is not built (bazel build //images:launcher)")
    cfg = harness.config(tmp_path, tokens_file=harness.admin_tokens_file(tmp_path))
    cfg.images.cache_dir = str(cache_dir)  # the launchers of this file's tests share it
    # The cancel test wants the trainer's own exit (75): its checkpoint's fsync can outlast the
    # harness's 2 s grace on a loaded disk (it did once, in a suite uploading to the cache).
    cfg.kill_grace_seconds = 30
    cfg.paths.allowed_roots.append(os.path.dirname(os.path.realpath(LAYOUT)))  # images it may name
    behaviour = str(tmp_path / "behaviour")
    cfg.images.entrypoint = f"python3 {FAKE_TRAINER} --behaviour-dir {behaviour}"
    cfg.images.binds.extend([os.path.dirname(FAKE_TRAINER), behaviour])
    launcher, _ = harness.start(cfg)
    client = Client(launcher.address, token="admin-token")
    yield tmp_path, client
    client.close()
    launcher.stop()


def test_a_job_runs_in_the_image_and_reports_progress(in_image, cache_dir):
    tmp_path, client = in_image
    harness.behave(tmp_path, "boxed", steps=4, step_seconds=0.05)
    job_id = client.submit(harness.spec("boxed", steps=4, image=LAYOUT)).id
    job = harness.wait_for(client, job_id, harness.FINAL, timeout=120)
    log = open(os.path.join(attempt_dir(job.run_dir, 1), "output.log")).read()
    assert job.state == job_pb2.SUCCEEDED, log
    assert job.progress.step == 4  # streamed over gRPC from inside the container
    # unpacked into the launcher's image cache, not again into the job's own HOME
    unpacked = [d for d in os.listdir(cache_dir) if not d.startswith(".") and "." not in d]
    assert len(unpacked) == 1, unpacked  # <manifest digest>/, beside its .lock
    assert not os.path.exists(os.path.join(job.run_dir, "home", ".cache")), log
    assert harness.steps_log(job) == [(1, s) for s in range(1, 5)]


def test_cancel_reaches_the_trainer_in_the_image(in_image):
    tmp_path, client = in_image
    harness.behave(tmp_path, "long", steps=1000, step_seconds=0.05)
    job_id = client.submit(harness.spec("long", steps=1000, image=LAYOUT)).id
    running = harness.wait_for_step(client, job_id, 2, timeout=120)  # with the token file
    attempt = attempt_dir(running.run_dir, 1)
    token = open(os.path.join(attempt, "token")).read()
    pids = harness.process_tree(harness.written_json(os.path.join(attempt, "pid.json"))["pid"])
    assert len(pids) >= 3  # the wrapper, run_image.py, bwrap and the trainer inside
    assert harness.where_it_shows(token, pids) == []
    client.cancel(job_id)
    job = harness.wait_for(client, job_id, harness.FINAL, timeout=60)
    assert job.state == job_pb2.CANCELLED
    log = open(os.path.join(attempt, "output.log")).read()
    # SIGTERM forwarded into the container: the trainer checkpoints and exits 75 (not 137).
    assert harness.written_json(os.path.join(attempt, "exit.json"))["code"] == 75, log


@pytest.mark.parametrize(
    "image, problem",
    [
        ("/nonexistent/trainer.oci", "not an OCI image layout"),
        (".bazel/bin/images/trainer.oci", "absolute path"),
        ("127.0.0.1:5000/kitchen/trainer:latest", "pinned by digest"),
        ("127.0.0.1:5000/kitchen/trainer@sha256:abc", "pinned by digest"),
    ],
)
def test_a_bad_image_is_refused_and_nothing_is_stored(tmp_path, image, problem):
    launcher, client = harness.start(harness.config(tmp_path))
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.submit(harness.spec("bad", image=image))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("spec.image: ")
        assert problem in refused.value.details()
        assert list(client.list().jobs) == []
    finally:
        launcher.stop()


def test_an_image_job_runs_on_one_node(tmp_path):
    """Several processes on one node run under torchrun inside the image; several nodes in an
    image are refused on a Slurm pool (a local pool is one machine anyway)."""
    cfg = settings.resolve(harness.config(tmp_path))
    cfg.pools.add(name="slurm", executor=launcher_pb2.SLURM, nodes=2)
    spec = harness.spec("wide", image=f"127.0.0.1:5000/kitchen/trainer@{DIGEST}")
    spec.resources.pool, spec.resources.processes_per_node = "slurm", 2
    assert validation.validate(spec, cfg, lambda _: None) == "slurm"
    spec.resources.nodes = 2
    with pytest.raises(ConfigError) as refused:
        validation.validate(spec, cfg, lambda _: None)
    assert refused.value.field == "image" and "2 asked" in str(refused.value)


@pytest.mark.parametrize(
    "image", ["registry.local/kitchen/trainer:latest", "/work/main/.bazel/bin/images/trainer.oci"]
)
def test_a_kubernetes_pool_takes_only_a_digest(tmp_path, image):
    """A cluster pulls the image: a tag could name other bytes on the next attempt, and a layout
    directory on the launcher's machine is nothing to it. The pool's own image obeys the same
    rule when the launcher starts."""
    cfg = settings.resolve(harness.config(tmp_path))
    k8s = cfg.pools.add(name="k8s", executor=launcher_pb2.KUBERNETES, nodes=2)
    k8s.kubernetes.image = f"registry.local/kitchen/trainer@{DIGEST}"
    spec = harness.spec("pulled")
    spec.resources.pool = "k8s"
    assert validation.validate(spec, cfg, lambda _: None) == "k8s"  # the pool's pinned image
    spec.image = f"registry.local/kitchen/trainer@{DIGEST}"
    assert validation.validate(spec, cfg, lambda _: None) == "k8s"
    spec.image = image
    with pytest.raises(ConfigError) as refused:
        validation.validate(spec, cfg, lambda _: None)
    assert refused.value.field == "image" and "pin it by digest" in str(refused.value)

    bad = harness.config(tmp_path)
    pool = bad.pools.add(name="k8s", executor=launcher_pb2.KUBERNETES)
    pool.kubernetes.image = "registry.local/kitchen/trainer:latest"
    with pytest.raises(ConfigError) as refused:
        settings.resolve(bad)
    assert refused.value.field.endswith("].kubernetes.image")


def _slurm_script(tmp_path, gpus: int = 0, processes: int = 1) -> tuple[str, Any, Any]:
    tmp_path.mkdir(exist_ok=True)
    ca = tmp_path / "ca.pem"
    ca.write_text("a PEM root certificate\n")
    tls = {"tls_cert": str(ca), "tls_key": str(tmp_path / "key.pem")}  # the key stays unread
    cfg = settings.resolve(harness.config(tmp_path, advertise="127.0.0.1:1", **tls))
    job = job_pb2.Job(id="j1", attempts=1, run_dir=str(tmp_path / "run"))
    job.spec.image = f"127.0.0.1:5000/kitchen/trainer@{DIGEST}"
    job.spec.resources.gpus_per_node, job.spec.resources.processes_per_node = gpus, processes
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": "/host/only"}
    handle: dict[str, Any] = {"attempt_dir": attempt_dir(job.run_dir, 1), "launched_at": 0.0}
    attempt = handoff.write(job, cfg, handle["attempt_dir"], "the-attempt-token")
    launch = Launch(job, attempt, list(cfg.trainer_cmd), env, handle)
    script = SlurmExecutor(cfg.pools[0].slurm, [], images=cfg.images)._script(launch)
    return script, cfg, job


def test_gpus_and_several_processes_go_into_the_image(tmp_path):
    """Slurm picks the GPUs when the job starts, so the script passes them from its env
    ($SLURM_JOB_GPUS, expanded by bash); several processes run under torchrun inside."""
    script, _, _ = _slurm_script(tmp_path, gpus=2, processes=2)
    last = script.splitlines()[-1]
    assert " --gpus=$SLURM_JOB_GPUS " in last  # unquoted: the shell expands it
    command = shlex.split(last)
    assert "--nproc-per-node=2" in command and command.index("--nproc-per-node=2") < command.index(
        "--attempt"
    )
    no_gpus, _, _ = _slurm_script(tmp_path / "cpu")
    assert "--gpus" not in no_gpus and "--nproc-per-node" not in no_gpus


def test_a_slurm_batch_script_runs_the_trainer_through_run_image(tmp_path):
    script, cfg, job = _slurm_script(tmp_path)
    ca = tmp_path / "ca.pem"
    handle = {"attempt_dir": attempt_dir(job.run_dir, 1)}
    command = shlex.split(script.splitlines()[-1])
    run_image = command.index("--")  # attempt_wrapper.py ... -- run_image.py ...
    precook = os.path.join(cfg.state_dir, "precook")
    assert command[run_image + 1 :] == [
        *cfg.images.run_image_cmd,
        "--image", job.spec.image, "--runtime", "bwrap",
        "--cache-dir", os.path.join(cfg.state_dir, "images"),  # one unpack for every job
        "--bind", job.run_dir, "--bind", precook, "--bind", str(ca),
        "--env=PYTHONUNBUFFERED=1",
        "--", "--attempt", os.path.join(handle["attempt_dir"], "attempt.json"),
    ]  # fmt: skip
    assert os.path.isdir(precook)  # a bind mount's source must exist
    assert "the-attempt-token" not in script  # it is in the token file, in the run dir
