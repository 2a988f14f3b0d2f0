import math

from trainer.loss_guard import MIN_HISTORY, LossGuard, Verdict


def warmed(spike_factor=3.0, max_bad=3) -> LossGuard:
    guard = LossGuard(spike_factor, max_bad)
    for i in range(MIN_HISTORY):
        assert guard.check(4.0 - 0.01 * i) == Verdict.OK
    return guard


def test_nan_and_inf_are_always_skipped():
    guard = LossGuard(3.0, 5)
    assert guard.check(math.nan) == Verdict.SKIP  # even before any history
    assert guard.check(math.inf) == Verdict.SKIP
    assert guard.skipped == 2


def test_spike_over_the_recent_median_is_skipped():
    guard = warmed()
    assert guard.check(3.0 * 3.96) == Verdict.OK  # just under 3x the median (3.965)
    assert guard.check(12.5) == Verdict.SKIP
    assert guard.check(3.9) == Verdict.OK
    assert guard.skipped == 1 and guard.bad_in_a_row == 0


def test_early_losses_are_never_called_spikes():
    guard = LossGuard(3.0, 3)
    assert [guard.check(x) for x in (10.0, 50.0, 2.0)] == [Verdict.OK, Verdict.OK, Verdict.OK]


def test_bad_steps_in_a_row_ask_for_a_rollback():
    guard = warmed(max_bad=3)
    assert [guard.check(x) for x in (100.0, math.nan, 100.0)] == [
        Verdict.SKIP,
        Verdict.SKIP,
        Verdict.ROLLBACK,
    ]
    assert guard.rollbacks == 1 and guard.skipped == 3 and guard.bad_in_a_row == 0
    # Counting restarts after the rollback.
    assert guard.check(100.0) == Verdict.SKIP


def test_state_round_trips():
    guard = warmed()
    guard.check(math.nan)
    other = LossGuard(3.0, 3)
    other.load_state_dict(guard.state_dict())
    assert other.state_dict() == guard.state_dict()
    assert other.check(100.0) == guard.check(100.0) == Verdict.SKIP
