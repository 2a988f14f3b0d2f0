"""Time this process spends blocked in collectives, and where it is: the straggler score's
"waiting on peers" and the watchdog's "which collective is this rank in".

trainer/distributed.py wraps each synchronous collective in `TRACKER.waiting()`. Under DDP the
gradient all-reduce runs asynchronously in buckets during the backward pass; `ddp_comm_hook`
times them, and only the exposed part counts (from the last bucket's launch, i.e. the end of
this rank's backward, to the last completion): a rank that finished its backward early waits
there for the slow one. FSDP's collectives are not timed (only the synchronous ones are).
"""

import contextlib
import threading
import time


class CollectiveTracker:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.entered = 0  # synchronous collectives entered (the watchdog compares ranks by it)
        self.inside = False  # in a synchronous collective now
        self.wait_seconds = 0.0  # all-time: synchronous collectives + exposed DDP buckets
        self.last_exit = clock()  # when a collective last completed (a sign of progress)
        self._lock = threading.Lock()  # DDP completions arrive on a communication thread
        self._launched: float | None = None
        self._completed: float | None = None

    @contextlib.contextmanager
    def waiting(self):
        self.entered += 1
        self.inside = True
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            with self._lock:
                self.wait_seconds += end - start
                self.inside = False
                self.last_exit = end

    def bucket_launched(self) -> None:
        with self._lock:
            self._launched = self.clock()

    def bucket_done(self) -> None:
        with self._lock:
            self._completed = self.last_exit = self.clock()

    def end_step(self) -> None:
        """Adds the step's exposed DDP wait (call once the optimizer step is done, and after
        the first run of a replayed step: each backward has its own)."""
        with self._lock:
            if self._launched is not None and self._completed is not None:
                self.wait_seconds += max(0.0, self._completed - self._launched)
            self._launched = self._completed = None


TRACKER = CollectiveTracker()  # one per process


def ddp_comm_hook(tracker: CollectiveTracker):
    """DDP's default all-reduce (average), timed by `tracker`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        tracker.bucket_launched()
        future = default_hooks.allreduce_hook(state, bucket)

        def done(f):
            tracker.bucket_done()
            return f.value()  # the averaged bucket

        return future.then(done)

    return hook
