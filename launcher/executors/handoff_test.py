"""The launcher's handoff to an attempt, with a real launcher and the fake trainer: attempt.json
says everything the trainer needs, the token lives only in a 0600 file, and no process of the
attempt carries it in its argv or environment."""

import os
import stat

from google.protobuf import json_format

from launcher.client import Client
from launcher.executors import handoff
from launcher.executors.base import attempt_dir, read_json
from launcher.testdata import harness as h
from protos import attempt_pb2, job_pb2, launcher_pb2


def read_attempt(path) -> attempt_pb2.Attempt:
    with open(path) as f:
        return json_format.Parse(f.read(), attempt_pb2.Attempt())


def test_write_puts_the_token_in_a_private_file_and_the_rest_in_attempt_json(tmp_path):
    job = job_pb2.Job(id="j7", attempts=2, run_dir=str(tmp_path / "runs" / "j7"))
    job.spec.name, job.spec.trainer.train.steps = "tiny", 5
    cfg = launcher_pb2.LauncherConfig(
        state_dir=str(tmp_path), advertise="10.0.0.1:50051", tls_cert="/etc/kitchen/ca.pem"
    )
    where = attempt_dir(job.run_dir, 2)
    attempt = handoff.write(job, cfg, where, "s3cret-token")
    token_file = os.path.join(where, "token")
    assert read_attempt(os.path.join(where, "attempt.json")) == attempt
    assert attempt == attempt_pb2.Attempt(
        job_id="j7", number=2, spec=job.spec, run_dir=job.run_dir,
        cache_dir=str(tmp_path / "precook"), launcher="10.0.0.1:50051",
        token_file=token_file, tls_ca="/etc/kitchen/ca.pem",
    )  # fmt: skip
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert open(token_file).read() == "s3cret-token"
    assert "s3cret-token" not in open(os.path.join(where, "attempt.json")).read()

    job.spec.trainer.data.cache_dir = str(tmp_path / "my-cache")  # the user's choice wins
    job.attempts = 3
    without_auth = handoff.write(job, cfg, attempt_dir(job.run_dir, 3), "")
    assert (without_auth.token_file, without_auth.cache_dir) == ("", str(tmp_path / "my-cache"))
    assert not os.path.exists(os.path.join(attempt_dir(job.run_dir, 3), "token"))


def test_the_launcher_decides_the_cache_and_whether_task_files_may_run_code(tmp_path):
    cfg = launcher_pb2.LauncherConfig(state_dir=str(tmp_path), task_code_teams=["nlp"])
    job = job_pb2.Job(id="j1", attempts=1, run_dir=str(tmp_path / "runs" / "j1"))
    job.spec.team = "nlp"
    trusted = handoff.write(job, cfg, attempt_dir(job.run_dir, 1), "")
    assert trusted.spec.trainer.eval.allow_task_code
    assert trusted.cache_dir == str(tmp_path / "precook" / "nlp")  # a team's own datasets
    job.spec.team = "speech"
    job.spec.trainer.eval.allow_task_code = True  # the submitter's word counts for nothing
    other = handoff.write(job, cfg, attempt_dir(job.run_dir, 1), "")
    assert not other.spec.trainer.eval.allow_task_code
    assert other.cache_dir == str(tmp_path / "precook" / "speech")


def test_the_token_is_in_no_argv_or_environment_of_the_attempt(tmp_path):
    cfg = h.config(tmp_path, tokens_file=h.admin_tokens_file(tmp_path))
    launcher, _ = h.start(cfg)
    client = Client(launcher.address, token="admin-token")
    try:
        h.behave(tmp_path, "long", steps=10_000, step_seconds=0.05)
        job = client.submit(h.spec("long"))
        h.wait_for_step(client, job.id, 2)  # reported with the token read from token_file
        where = attempt_dir(job.run_dir, 1)
        token_file = os.path.join(where, "token")
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = open(token_file).read()
        assert launcher.store.attempt_token_matches(job.id, token)
        attempt = read_attempt(os.path.join(where, "attempt.json"))
        assert (attempt.job_id, attempt.number, attempt.run_dir) == (job.id, 1, job.run_dir)
        assert (attempt.launcher, attempt.token_file) == (launcher.address, token_file)

        pid_file = read_json(os.path.join(where, "pid.json"))
        assert pid_file is not None
        wrapper = pid_file["pid"]
        pids = h.process_tree(wrapper)
        assert len(pids) >= 2  # the wrapper and the fake trainer
        with open(f"/proc/{pids[-1]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[-3:-1] == [b"--attempt", os.path.join(where, "attempt.json").encode()]
        assert h.where_it_shows(token, pids) == []
        assert h.where_it_shows(token, [os.getpid()]) == []  # nor the launcher's own
        client.cancel(job.id)
        assert h.wait_for(client, job.id, h.FINAL).state == job_pb2.CANCELLED
    finally:
        client.close()
        launcher.stop()


def test_each_attempt_gets_its_own_handoff_and_token(tmp_path):
    cfg = h.config(tmp_path, tokens_file=h.admin_tokens_file(tmp_path))
    launcher, _ = h.start(cfg)
    client = Client(launcher.address, token="admin-token")
    try:
        h.behave(tmp_path, "crashy", steps=4, crash_at=2, crash_attempts=[1])
        job = client.submit(h.spec("crashy"))
        done = h.wait_for(client, job.id, h.FINAL)
        assert (done.state, done.attempts, done.progress.step) == (job_pb2.SUCCEEDED, 2, 4)
        dirs = [attempt_dir(job.run_dir, n) for n in (1, 2)]
        numbers = [read_attempt(os.path.join(d, "attempt.json")).number for d in dirs]
        tokens = {open(os.path.join(d, "token")).read() for d in dirs}
        assert numbers == [1, 2] and len(tokens) == 2
    finally:
        client.close()
        launcher.stop()
