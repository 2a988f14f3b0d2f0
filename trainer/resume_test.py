"""Exact resume: a run killed with SIGKILL and restarted gives the same loss at every step and
bitwise the same final weights as a run that was never interrupted (CPU, fp32)."""

import signal

import torch

from trainer.testing import (
    final_weights,
    run_trainer,
    start_trainer,
    tiny_job,
    train_losses,
    wait_for_step,
    write_job,
)

STEPS = 24


def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
    # grad_accum 2 also exercises the noise-scale state; checkpoints every 4 steps.
    job = write_job(
        tmp_path / "job.yaml",
        tiny_job(
            tmp_path / "cache", steps=STEPS, train={"grad_accum": 2}, checkpoint={"every_steps": 4}
        ),
    )
    straight = run_trainer("--config", job, "--run-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stdout + straight.stderr

    interrupted = tmp_path / "interrupted"
    process = start_trainer("--config", job, "--run-dir", interrupted, log_path=tmp_path / "a.log")
    seen = wait_for_step(interrupted, 6, process)  # past the step-4 checkpoint
    process.send_signal(signal.SIGKILL)
    assert process.wait(30) == -signal.SIGKILL
    killed_at = max(step for step, _ in train_losses(interrupted))
    assert 6 <= seen <= killed_at < STEPS, "the kill must land mid-run"

    resumed = run_trainer("--config", job, "--run-dir", interrupted)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout

    expected = dict(train_losses(tmp_path / "straight"))
    assert sorted(expected) == list(range(1, STEPS + 1))
    got = train_losses(interrupted)
    # Every logged step, including those logged twice (before the kill and again after the
    # resume), has exactly the uninterrupted run's loss.
    assert len(got) > STEPS
    for step, loss in got:
        assert loss == expected[step], (step, loss, expected[step])
    assert {step for step, _ in got} == set(expected)

    a, b = final_weights(tmp_path / "straight"), final_weights(interrupted)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
