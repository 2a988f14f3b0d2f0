"""`submit` as a person runs it: a subprocess with an embedded launcher (fake trainer), or
sending to a running launcher. The exit code is the job's outcome."""

import os
import signal
import subprocess
import sys
import time

from launcher.testdata import harness as h
from protos import job_pb2


def run_submit(tmp_path, *argv, env=None, **popen):
    behaviour = tmp_path / "behaviour"
    behaviour.mkdir(exist_ok=True)
    trainer = f"{sys.executable} {h.FAKE_TRAINER} --behaviour-dir {behaviour}"
    cmd = [sys.executable, "-m", "launcher.submit", "--state-dir", str(tmp_path / "state")]
    cmd += ["--trainer-cmd", trainer, *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    if popen:
        return subprocess.Popen(cmd, env=env, text=True, **popen)
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=120)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_embedded_run_to_success(tmp_path):
    config = write(tmp_path, "small.yaml", "kind: pretrain\ntrainer: {train: {steps: 5}}\n")
    done = run_submit(tmp_path, "--config", config)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "launcher: embedded on 127.0.0.1:" in out and "metrics:  http://127.0.0.1:" in out
    assert "submitted j1 (small, pretrain)" in out  # the name defaults to the file's
    assert "j1 SUCCEEDED" in out and "final loss 2.000 at step 5" in out


def test_bad_configs_exit_2_naming_the_field(tmp_path):
    bad_yaml = write(tmp_path, "bad.yaml", "kind: pretrain\ntrainer: {model: {n_heads: x}}\n")
    done = run_submit(tmp_path, "--config", bad_yaml)
    assert done.returncode == 2
    assert (
        done.stderr.strip() == f"submit: {bad_yaml}: trainer.model.n_heads: expected int, got 'x'"
    )
    assert not (tmp_path / "state").exists()  # nothing started, nothing stored
    too_big = write(tmp_path, "big.yaml", "kind: pretrain\nresources: {nodes: 4}\n")
    done = run_submit(tmp_path, "--config", too_big)
    assert done.returncode == 2
    assert "INVALID_ARGUMENT: spec.resources.nodes: 4 nodes, but pool cpu has 1" in done.stderr
    # The schema's own rules run before anything starts, with the file named.
    nan = write(tmp_path, "nan.yaml", "kind: pretrain\nretry: {backoff_seconds: .nan}\n")
    done = run_submit(tmp_path, "--config", nan)
    assert done.returncode == 2
    assert (
        done.stderr.strip() == f"submit: {nan}: retry.backoff_seconds: nan is not a finite number"
    )
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    done = run_submit(tmp_path, "--config", str(binary))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"submit: {binary}: (top level): not a UTF-8 text file"), done


def test_failed_job_exits_1(tmp_path):
    config = write(tmp_path, "crash.yaml", "kind: pretrain\nretry: {max_attempts: 1}\n")
    (tmp_path / "behaviour").mkdir()
    h.behave(tmp_path, "crash", crash_at=1, crash_attempts=[1])
    done = run_submit(tmp_path, "--config", config)
    assert done.returncode == 1
    assert "j1 FAILED" in done.stdout and "RuntimeError: crash at step 1 as told" in done.stdout


def test_detach_to_a_running_launcher_and_busy_state_dir(tmp_path):
    config = write(tmp_path, "small.yaml", "kind: pretrain\ntrainer: {train: {steps: 3}}\n")
    assert run_submit(tmp_path, "--config", config, "--detach").returncode == 2
    with h.started(h.config(tmp_path)) as (launcher, client):  # uses tmp_path/state
        done = run_submit(tmp_path, "--config", config, "--launcher", launcher.address, "--detach")
        assert done.returncode == 0, done.stderr
        assert "submitted j1 (small, pretrain)" in done.stdout
        assert h.wait_for(client, "j1", h.FINAL).state == job_pb2.SUCCEEDED
        busy = run_submit(tmp_path, "--config", config)  # embedded on the same state dir
        assert busy.returncode == 2 and "is in use by a launcher" in busy.stderr


def test_ctrl_c_cancels_the_job_after_its_checkpoint(tmp_path):
    config = write(tmp_path, "long.yaml", "kind: pretrain\n")
    (tmp_path / "behaviour").mkdir()
    h.behave(tmp_path, "long", steps=10_000, step_seconds=0.05)
    proc = run_submit(
        tmp_path, "--config", config, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while not any(line.startswith("RUNNING ") for line in lines):  # a progress row: step > 0
        assert time.monotonic() < deadline and proc.poll() is None, lines
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, rest
    assert "cancelling: the trainer saves a checkpoint first" in rest
    assert "j1 CANCELLED" in rest
    log = (tmp_path / "state" / "runs" / "j1" / "attempts" / "001" / "output.log").read_text()
    assert "SIGTERM: checkpoint at step" in log
