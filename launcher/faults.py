"""How the control loop lives with failures that repeat: backoff per key, and logs without floods.

A failure that comes back every pass (a full disk under the store, squeue gone, a bug that one
job's spec triggers) must neither spin the loop nor write a traceback per pass. `Holds` keeps,
per key (a job id, a pool), when to try again: the delay doubles from HOLD_FIRST_SECONDS up to
HOLD_MAX_SECONDS and a success clears it. `ErrorLog` logs each distinct error once, with its
traceback, and says once when its kind works again (from any thread).
"""

import dataclasses
import logging
import threading

HOLD_FIRST_SECONDS = 0.5
HOLD_MAX_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Hold:
    retry_at: float
    delay: float
    error: str


class Holds:
    def __init__(self, first: float = HOLD_FIRST_SECONDS, most: float = HOLD_MAX_SECONDS):
        self.first, self.most = first, most
        self._holds: dict[str, Hold] = {}

    def hold(self, key: str, error: BaseException, now: float) -> Hold:
        """Another failure for `key`: wait longer before the next try."""
        last = self._holds.get(key)
        delay = self.first if last is None else min(last.delay * 2, self.most)
        self._holds[key] = hold = Hold(now + delay, delay, f"{type(error).__name__}: {error}")
        return hold

    def held(self, key: str, now: float) -> bool:
        hold = self._holds.get(key)
        return hold is not None and now < hold.retry_at

    def get(self, key: str) -> Hold | None:
        return self._holds.get(key)

    def items(self) -> list[tuple[str, Hold]]:
        """Every (key, hold): few, so a pass visits these rather than every queued job."""
        return list(self._holds.items())

    def clear(self, key: str):
        self._holds.pop(key, None)


class ErrorLog:
    """Logs each distinct error (kind, type and message) once; `recovered(kind)` says once
    that a kind that failed works again, with how often it failed meanwhile."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self._lock = threading.Lock()
        self._seen: dict[str, dict[str, int]] = {}  # kind -> {error text: times}

    def failed(self, kind: str, error: BaseException, what: str = ""):
        text = f"{type(error).__name__}: {error}"
        with self._lock:
            seen = self._seen.setdefault(kind, {})
            seen[text] = times = seen.get(text, 0) + 1
        if times == 1:
            self.log.error(
                "%s%s failed: %s (logged once; retried with backoff)",
                kind, f" ({what})" if what else "", text, exc_info=error,
            )  # fmt: skip

    def recovered(self, kind: str):
        with self._lock:
            seen = self._seen.pop(kind, None)
        if seen:
            self.log.warning("%s works again (after %d failures)", kind, sum(seen.values()))
