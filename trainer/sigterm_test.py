"""SIGTERM (a preemption): the trainer saves a checkpoint at the step it is on and exits 75;
started again, it resumes there and ends exactly where an uninterrupted run ends."""

import json
import signal

import torch

from protos.exit_codes import ExitCode
from protos.progress_log import read_progress_log
from trainer.testing import (
    final_weights,
    run_trainer,
    start_trainer,
    tiny_job,
    train_losses,
    wait_for_step,
    write_job,
)

STEPS = 30


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(tmp_path):
    # No periodic checkpoints: the only one is written on SIGTERM.
    spec = tiny_job(tmp_path / "cache", steps=STEPS, checkpoint={"every_steps": 0})
    job = write_job(tmp_path / "job.yaml", spec)
    run = tmp_path / "run"
    process = start_trainer("--config", job, "--run-dir", run, log_path=tmp_path / "a.log")
    wait_for_step(run, 3, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == ExitCode.PREEMPTED, (tmp_path / "a.log").read_text()

    records = read_progress_log(run).records
    stopped_at = max(r.step for r in records if r.phase == "train")
    assert stopped_at < STEPS, "the signal must land mid-run"
    assert records[-1].phase == "preempted"
    (saved,) = (run / "checkpoints").iterdir()
    assert json.loads((saved / "meta.json").read_text())["step"] == stopped_at
    assert "stop requested: saved" in (tmp_path / "a.log").read_text()

    resumed = run_trainer("--config", job, "--run-dir", run)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(step {stopped_at})" in resumed.stdout

    straight = run_trainer("--config", job, "--run-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert train_losses(run) == train_losses(tmp_path / "straight")  # nothing lost or redone
    a, b = final_weights(run), final_weights(tmp_path / "straight")
    assert all(torch.equal(a[name], b[name]) for name in a)
