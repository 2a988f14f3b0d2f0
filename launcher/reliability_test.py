"""What must survive: a launcher killed with -9, a trainer killed with -9, a hung trainer,
preemption and failing trainers. Real processes throughout; the fake trainer logs every step
it runs, so "nothing ran twice" and "resumed from the checkpoint" are checked on its log."""

import os
import signal
import time

from launcher.testdata import harness as h
from protos import job_pb2


def assert_each_step_once(job, attempts=(1,)):
    steps = h.steps_log(job)
    assert sorted(s for _, s in steps) == list(range(1, len(steps) + 1)), steps
    assert {a for a, _ in steps} == set(attempts), steps


def test_kill9_launcher_with_jobs_queued_running_and_stopping(tmp_path):
    cfg = h.config(tmp_path, nodes=3)
    h.behave(tmp_path, "long", steps=25, step_seconds=0.12)
    h.behave(tmp_path, "short", steps=6, step_seconds=0.12)  # ends while the launcher is down
    h.behave(tmp_path, "stubborn", steps=10_000, step_seconds=0.05, ignore_term=True,
             hang_at=10**9, hang_attempts=[1])  # fmt: skip
    proc = h.LauncherProcess(tmp_path, cfg)
    client = proc.start()
    try:
        long = client.submit(h.spec("long"))
        short = client.submit(h.spec("short"))
        stubborn = client.submit(h.spec("stubborn"))
        queued = [client.submit(h.spec(f"queued{i}", steps=3)) for i in range(3)]
        for job in (long, short, stubborn):
            h.wait_for_step(client, job.id, 2)
        assert client.cancel(stubborn.id).stop == job_pb2.STOP_CANCEL  # ignores SIGTERM
        proc.kill9()
        time.sleep(1.5)
        client = proc.start()
        for job in (long, short, *queued):
            done = h.wait_for(client, job.id, h.FINAL, timeout=60)
            assert (done.state, done.attempts) == (job_pb2.SUCCEEDED, 1), done
            assert_each_step_once(done)
        done = h.wait_for(client, stubborn.id, h.FINAL, timeout=30)
        assert done.state == job_pb2.CANCELLED  # the stop went on after the restart
        assert len(client.list(page_size=100).jobs) == 6
    finally:
        proc.stop()


def test_kill9_trainer_is_retried_from_its_checkpoint(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        h.behave(tmp_path, "victim", steps=16, step_seconds=0.08, checkpoint_every=4)
        job = client.submit(h.spec("victim"))
        h.wait_for_step(client, job.id, 6)
        pids = h.written_json(os.path.join(job.run_dir, "attempts", "001", "pid.json"))
        os.kill(pids["child_pgid"], signal.SIGKILL)
        reasons = {u.exit_reason for u in client.watch(job.id)}
        done = client.get(job.id)
        assert (done.state, done.attempts, done.failures) == (job_pb2.SUCCEEDED, 2, 1)
        assert any(r.startswith("exit code 137") and "retrying" in r for r in reasons), reasons
        steps = h.steps_log(done)
        first_of_retry = min(s for a, s in steps if a == 2)
        assert first_of_retry > 1 and (first_of_retry - 1) % 4 == 0, steps  # from a checkpoint
        assert max(s for a, s in steps if a == 1) < 16


def test_hung_trainer_is_detected_killed_and_restarted(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        h.behave(tmp_path, "hangs", steps=8, hang_at=3, hang_attempts=[1], ignore_term=True)
        spec = h.spec("hangs")
        spec.hang_timeout_seconds = 1.5
        job = client.submit(spec)
        reasons = {u.exit_reason for u in client.watch(job.id)}
        done = client.get(job.id)
        assert (done.state, done.attempts, done.failures) == (job_pb2.SUCCEEDED, 2, 1)
        assert any(r.startswith("hung: no progress for") for r in reasons), reasons
        assert_each_step_once(done, attempts=(1, 2))


def test_preemption_checkpoints_requeues_and_resumes(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        h.behave(tmp_path, "low", steps=30, step_seconds=0.05, checkpoint_every=1)
        low = client.submit(h.spec("low", priority=0))
        h.wait_for_step(client, low.id, 3)
        high = client.submit(h.spec("high", steps=4, priority=10))
        h.wait_for(client, low.id, [job_pb2.PREEMPTED])
        high_done = h.wait_for(client, high.id, h.FINAL)
        low_done = h.wait_for(client, low.id, h.FINAL)
        assert high_done.state == low_done.state == job_pb2.SUCCEEDED
        assert (low_done.attempts, low_done.preemptions, low_done.failures) == (2, 1, 0)
        preempted_at = h.written_json(os.path.join(low.run_dir, "attempts", "001", "exit.json"))
        assert preempted_at["code"] == 75
        assert high_done.started.ToNanoseconds() / 1e9 >= preempted_at["finished"] - 0.01
        assert_each_step_once(low_done, attempts=(1, 2))


def test_retries_back_off_then_fail_with_the_log_line(tmp_path):
    with h.started(h.config(tmp_path)) as (launcher, client):
        h.behave(tmp_path, "crashy", crash_at=2, crash_attempts=[1, 2, 3])
        spec = h.spec("crashy")
        spec.retry.max_attempts = 3
        job = client.submit(spec)
        done = h.wait_for(client, job.id, h.FINAL)
        assert (done.state, done.attempts, done.failures) == (job_pb2.FAILED, 3, 3)
        assert "RuntimeError: crash at step 2 as told" in done.exit_reason
        assert done.exit_reason.endswith("(failure 3 of 3)")
        ends = [
            h.written_json(os.path.join(job.run_dir, "attempts", f"{n:03d}", "exit.json"))
            for n in (1, 2)
        ]
        starts = [
            os.path.getmtime(os.path.join(job.run_dir, "attempts", f"{n:03d}", "pid.json"))
            for n in (2, 3)
        ]
        assert starts[0] - ends[0]["finished"] >= 0.2 and starts[1] - ends[1]["finished"] >= 0.4

        h.behave(tmp_path, "badcfg", exit_code=2)
        bad = h.wait_for(client, client.submit(h.spec("badcfg")).id, h.FINAL)
        assert (bad.state, bad.attempts) == (job_pb2.FAILED, 1)
        assert bad.exit_reason.startswith("bad config (exit code 2")
