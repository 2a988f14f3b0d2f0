"""Each failure injected into a real 4-process run (torchrun, gloo on 127.0.0.1) is detected.

One run, three faults (KITCHEN_FAULTS, trainer/health/faults.py), in order:
- rank 1 spends 0.5 s more on every step: the straggler score and the log name it;
- rank 2 flips one weight bit after step 3: the replica check at step 4 names it, every rank
  rolls back to the step-2 checkpoint and trains on, replaying steps 3-4 bit for bit;
- rank 3 stops at the start of step 7: the watchdog names it, every rank dumps its stacks,
  the job fails and the report points at the dumps.
The replay check (replay.py) runs beside the replica check on every 3rd step of every rank:
under DDP, with the gradient all-reduce run twice, a clean replay raises no alarm.
"""

import socket
import subprocess
import sys

import pytest
import torch

from protos import hang_report
from protos.exit_codes import ExitCode
from protos.progress_log import read_progress_log
from trainer.testing import subprocess_env, tiny_job, write_job

SLOW, FLIPPED, BLOCKED = 1, 2, 3
FACTOR = 1.5  # trainer.health.straggler_factor's default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    job = tiny_job(
        root / "cache",
        steps=10,
        checkpoint={"every_steps": 2},
        health={"sdc_check_every": 2, "hang_timeout_seconds": 8, "replay_check_every": 3},
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=4"),
        *("--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "trainer.main"),
        *("--config", str(write_job(root / "job.yaml", job)), "--run-dir", str(root / "run")),
    ]
    faults = f"slow:{SLOW}:0.5,bitflip:{FLIPPED}:3,block:{BLOCKED}:7"
    env = dict(subprocess_env(), GLOO_SOCKET_IFNAME="lo", KITCHEN_FAULTS=faults)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return root / "run", result


def log_lines(run_dir) -> list[str]:
    return (run_dir / "train.log").read_text().splitlines()


def test_the_slow_rank_is_named_by_its_straggler_score(run):
    run_dir, _ = run
    reports = [r.ranks for r in read_progress_log(run_dir).records if r.ranks]
    assert len(reports) >= 5 and all(len(ranks) == 4 for ranks in reports)
    # Step 2 is DDP's bucket-rebuild step, whose wait hides inside the forward: skip it.
    for ranks in reports[2:]:
        worst = max(ranks, key=lambda r: r.straggler_score)
        assert worst.rank == SLOW and worst.straggler_score > FACTOR, ranks
        assert worst.host == socket.gethostname()
    flagged = [line for line in log_lines(run_dir) if "straggler: rank" in line]
    assert flagged and all(f"straggler: rank {SLOW} on " in line for line in flagged)


def test_a_flipped_bit_is_caught_and_the_run_rolls_back_and_continues(run):
    run_dir, _ = run
    lines = log_lines(run_dir)
    caught = [line for line in lines if "silent data corruption" in line]
    assert len(caught) == 1, lines
    assert (
        "at step 4: replicas disagree" in caught[0] and f"suspect rank {FLIPPED} on " in caught[0]
    )
    assert caught[0].endswith("rolled back to step_00000002")
    records = read_progress_log(run_dir).records
    losses = [(r.step, r.loss) for r in records if r.phase == "train" and r.ranks]
    # Step 3 ran before the flip and again after the rollback: bit for bit the same.
    threes = [loss for step, loss in losses if step == 3]
    assert len(threes) == 2 and threes[0] == threes[1]
    assert max(step for step, _ in losses) == 6  # trained on until rank 3 blocked
    last = records[-1]
    # Replica checks at steps 2, 4, then (after the rollback) 4 and 6; replays at 3, 3 and 6,
    # all clean.
    assert any("replay checks every 3 steps" in line for line in lines)
    assert last.sdc_rollbacks == 1 and last.sdc_checks == 4 + 3, last
    assert [r.sdc_mismatches for r in last.ranks] == [int(r == FLIPPED) for r in range(4)]
    # The goodput account of the checkpoints written after the rollback has the bucket.
    train = torch.load(run_dir / "checkpoints" / "step_00000006" / "train.pt", weights_only=False)
    assert train["ranks"][0]["goodput"]["seconds"]["sdc_rollback"] > 0


def test_a_blocked_rank_is_named_and_every_rank_dumps_its_stacks(run):
    run_dir, result = run
    assert result.returncode != 0
    report = hang_report.read_report(str(run_dir))
    assert report is not None, result.stderr[-3000:]
    assert report.stuck_ranks == [BLOCKED] and report.step == 7
    assert f"rank {BLOCKED} on " in report.message and report.dumps in report.message
    assert f"exitcode  : {int(ExitCode.FAILED)}" in result.stderr
    assert report.message in "\n".join(log_lines(run_dir))
    for rank in range(4):
        dump = (run_dir / "hang" / f"rank-{rank}.txt").read_text()
        assert "Current thread" in dump and "in advance" in dump, rank
        waiting_in = "in before_step" if rank == BLOCKED else "in all_reduce_sum"
        assert waiting_in in dump, (rank, dump)
