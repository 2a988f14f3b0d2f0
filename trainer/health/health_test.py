"""The health pieces on one process: scores, checksums, fault parsing, the watchdog's verdict
and its dumps. The same pieces under torchrun with injected faults: faults_test.py."""

import json
import threading
import time

import pytest
import torch

from protos import hang_report
from protos.config_yaml import ConfigError
from trainer.health import faults, sdc, stragglers
from trainer.health.collectives import CollectiveTracker
from trainer.health.watchdog import Heartbeat, Watchdog, describe, stuck_ranks


def test_straggler_score_is_busy_time_over_the_median_rank():
    assert stragglers.straggler_scores([0.1, 0.1, 0.4, 0.1]) == pytest.approx([1, 1, 4, 1])
    assert stragglers.straggler_scores([0.0, 0.0]) == [1.0, 1.0]


def test_exposed_ddp_wait_is_from_the_last_launch_to_the_last_completion():
    now = [0.0]
    tracker = CollectiveTracker(clock=lambda: now[0])
    tracker.bucket_launched()  # an early bucket, overlapped with the backward
    now[0] = 0.3
    tracker.bucket_launched()  # the backward ends
    now[0] = 0.5
    tracker.bucket_done()
    now[0] = 1.25
    tracker.bucket_done()  # the slow peer arrives
    tracker.end_step()
    assert tracker.wait_seconds == pytest.approx(0.95)
    with tracker.waiting():
        now[0] = 1.5
    assert tracker.wait_seconds == pytest.approx(1.2) and tracker.entered == 1


def test_one_flipped_bit_changes_the_checksum_and_the_odd_rank_is_named():
    model = torch.nn.Linear(8, 8)
    before = sdc.bit_sum(model.parameters())
    sdc.flip_bit(model)
    assert sdc.bit_sum(model.parameters()) != before
    assert sdc.odd_ones_out([(1, 2), (1, 2), (1, 3), (1, 2)]) == [2]
    assert sdc.odd_ones_out([(1, 2)] * 4) == []
    assert sdc.odd_ones_out([(1, 2), (1, 3)]) == [0, 1]  # two replicas: either may be wrong


def test_checks_run_every_n_steps_and_before_every_save():
    checker = sdc.SdcChecker(every=5, checkpoint_every=4, last_step=10, enabled=True)
    assert [s for s in range(1, 11) if checker.due(s)] == [4, 5, 8, 10]
    assert not sdc.SdcChecker(5, 4, 10, enabled=False).due(5)


def test_fault_spec_errors_name_the_variable():
    assert faults.parse("slow:1:0.5, bitflip:2:5") == [
        faults.Fault(faults.FaultKind.SLOW, 1, 0.5),
        faults.Fault(faults.FaultKind.BITFLIP, 2, 5.0),
    ]
    for bad in ("slow:1", "melt:1:2", "slow:x:1", "block:-1:3"):
        with pytest.raises(ConfigError, match="KITCHEN_FAULTS"):
            faults.parse(bad)
    injector = faults.Injector(faults.parse("bitflip:0:3"), rank=0)
    assert [injector.flip_due(s) for s in (2, 3, 3)] == [False, True, False]


def test_the_rank_behind_is_the_stuck_one():
    beats = [Heartbeat(r, "h", 7, 36 if r == 2 else 37, r != 2, 10.0) for r in range(4)]
    assert [b.rank for b in stuck_ranks(beats)] == [2]
    message, _ = describe(beats, "/run/hang", 10)
    assert "rank 2 on h stopped outside any collective at step 7" in message
    assert "/run/hang/rank-*.txt" in message
    level = [Heartbeat(r, "h", 7, 37, True, 10.0) for r in range(4)]
    assert stuck_ranks(level) == []
    assert "every rank waits in collective #37" in describe(level, "/d", 10)[0]


def test_watchdog_dumps_stacks_and_reports_when_a_process_stops(tmp_path):
    exited = threading.Event()
    codes = []

    def exit(code):
        codes.append(code)
        exited.set()

    dog = Watchdog(tmp_path, 0, 1, timeout=0.3, tracker=CollectiveTracker(), exit=exit)
    dog.start()
    dog.beat(4)
    assert exited.wait(10)
    dog.stop()
    assert codes == [1]
    dump = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert json.loads(dump.splitlines()[0])["step"] == 5
    assert "test_watchdog_dumps_stacks_and_reports_when_a_process_stops" in dump  # main thread
    report = hang_report.read_report(str(tmp_path))
    assert report is not None and report.step == 5 and report.stuck_ranks == []
    assert str(tmp_path / "hang") in report.message


def test_a_beating_watchdog_stays_quiet(tmp_path):
    codes: list[int] = []
    dog = Watchdog(tmp_path, 0, 1, timeout=0.5, tracker=CollectiveTracker(), exit=codes.append)
    dog.start()
    for step in range(10):
        dog.beat(step)
        time.sleep(0.1)
    dog.stop()
    assert codes == [] and dog.fired is None and not (tmp_path / "hang").exists()
