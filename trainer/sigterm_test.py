"""SIGTERM (a preemption): the trainer saves a checkpoint at the step it is on and exits 75;
started again, it resumes there and finishes."""

import json
import signal

from trainer.metrics import read_records
from trainer.testing import run_trainer, start_trainer, tiny_job, wait_for_step, write_job

EXIT_PREEMPTED = 75


def test_sigterm_checkpoints_and_exits_75_then_resumes(tmp_path):
    steps = 200  # far more than it will reach before the signal
    job = write_job(
        tmp_path / "job.yaml",
        tiny_job(tmp_path / "cache", steps=steps, checkpoint={"every_steps": 0}),
    )
    run = tmp_path / "run"
    process = start_trainer("--config", job, "--run-dir", run, log_path=tmp_path / "a.log")
    wait_for_step(run, 3, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == EXIT_PREEMPTED, (tmp_path / "a.log").read_text()

    records = read_records(run)
    last_step = max(int(r["step"]) for r in records if r["phase"] == "train")
    assert last_step < steps
    assert records[-1]["phase"] == "preempted"
    # No periodic checkpoints: the one there was written on SIGTERM, at the step reached.
    (saved,) = (run / "checkpoints").iterdir()
    assert json.loads((saved / "meta.json").read_text())["step"] == last_step
    assert "stop requested: saved" in (tmp_path / "a.log").read_text()

    # Restarted with fewer steps to go, it continues from there.
    job = write_job(
        tmp_path / "job.yaml",
        tiny_job(tmp_path / "cache", steps=last_step + 3, checkpoint={"every_steps": 0}),
    )
    resumed = run_trainer("--config", job, "--run-dir", run)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(step {last_step})" in resumed.stdout
    after = [int(r["step"]) for r in read_records(run) if r["phase"] == "train"]
    assert after[-3:] == [last_step + 1, last_step + 2, last_step + 3]
