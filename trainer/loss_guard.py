"""Loss guard: a NaN/inf loss or a spike far above the recent median skips the update.

After `max_bad` bad steps in a row the caller rolls back to the last checkpoint (PaLM did
the same: restart from a checkpoint and skip the offending batches). A spike factor of inf
checks finiteness only: for a loss that is no distance to a target (a policy gradient's sits
around 0 and changes sign), "far above the median" means nothing.
"""

import enum
import math
import statistics
from collections import deque

WINDOW = 32  # recent good losses the median is taken over
MIN_HISTORY = 8  # no spike verdicts before this many good losses (the loss falls fast early)


class Verdict(enum.Enum):
    """What the guard makes of one step's loss."""

    OK = "ok"  # apply the update
    SKIP = "skip"  # drop it
    ROLLBACK = "rollback"  # drop it and restore the last checkpoint


class LossGuard:
    def __init__(self, spike_factor: float, max_bad: int):
        self.spike_factor = spike_factor
        self.max_bad = max_bad
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.bad_in_a_row = 0
        self.skipped = 0  # all-time count of skipped updates
        self.rollbacks = 0

    def check(self, loss: float) -> Verdict:
        if self.is_good(loss):
            self.recent.append(loss)
            self.bad_in_a_row = 0
            return Verdict.OK
        self.skipped += 1
        self.bad_in_a_row += 1
        if self.bad_in_a_row >= self.max_bad:
            self.bad_in_a_row = 0
            self.rollbacks += 1
            return Verdict.ROLLBACK
        return Verdict.SKIP

    def is_good(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        if len(self.recent) < MIN_HISTORY or math.isinf(self.spike_factor):
            return True
        return loss <= self.spike_factor * statistics.median(self.recent)

    def state_dict(self) -> dict:
        return {
            "recent": list(self.recent),
            "bad_in_a_row": self.bad_in_a_row,
            "skipped": self.skipped,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque(state["recent"], maxlen=WINDOW)
        self.bad_in_a_row = state["bad_in_a_row"]
        self.skipped = state["skipped"]
        self.rollbacks = state["rollbacks"]
