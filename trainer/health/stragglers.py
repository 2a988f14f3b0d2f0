"""Stragglers: which rank makes the others wait.

In synchronous data parallelism every rank's step takes as long as the slowest rank's, so step
time alone cannot tell them apart. What differs is how the step is spent: the slow rank works
the whole time, the others finish early and wait in the next collective. A rank's busy time is
its step time minus that wait; its straggler score is its busy time over the median rank's
(1.0: typical; 2.0: twice as busy as the median rank, so everyone else waits on it).

Every rank accumulates its own step, data and wait times; on each logged step the ranks
exchange their means (one all-gather of a few floats) and rank 0 reports them as
kitchen.v1.RankHealth, which the launcher exports with a `rank` label.
"""

import socket
import statistics

from protos import progress_pb2
from trainer import distributed
from trainer.health.collectives import CollectiveTracker


def straggler_scores(busy: list[float]) -> list[float]:
    """Each value over the median value (1.0 for all when the median is 0)."""
    median = statistics.median(busy)
    if median <= 0:
        return [1.0] * len(busy)
    return [b / median for b in busy]


class StragglerMonitor:
    def __init__(self, rank: int, tracker: CollectiveTracker):
        self.rank = rank
        self.host = socket.gethostname()
        self.tracker = tracker
        self._wait_at_start = 0.0
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.step_s = self.data_s = self.wait_s = 0.0

    def begin_step(self) -> None:
        self._wait_at_start = self.tracker.wait_seconds

    def end_step(self, step_s: float, data_s: float) -> None:
        self.tracker.end_step()
        self.steps += 1
        self.step_s += step_s
        self.data_s += data_s
        self.wait_s += self.tracker.wait_seconds - self._wait_at_start

    def report(self, sdc_mismatches: dict[int, int]) -> list[progress_pb2.RankHealth]:
        """Every rank's means since the last report, with scores (a collective: all ranks
        call it on the same steps). `sdc_mismatches`: checks lost, by rank."""
        n = max(self.steps, 1)
        mine = (self.rank, self.host, self.step_s / n, self.data_s / n, self.wait_s / n)
        self._reset()
        gathered = distributed.gather_objects(mine)
        scores = straggler_scores([max(step - wait, 0.0) for _, _, step, _, wait in gathered])
        return [
            progress_pb2.RankHealth(
                rank=rank,
                host=host,
                step_time_seconds=step,
                data_time_seconds=data,
                collective_wait_seconds=wait,
                straggler_score=score,
                sdc_mismatches=sdc_mismatches.get(rank, 0),
            )
            for (rank, host, step, data, wait), score in zip(gathered, scores, strict=True)
        ]


def describe_stragglers(ranks: list[progress_pb2.RankHealth], factor: float) -> list[str]:
    """A log line for each rank whose score exceeds `factor`."""
    others = [r.collective_wait_seconds for r in ranks if r.straggler_score <= factor]
    typical_wait = statistics.median(others) if others else 0.0
    return [
        f"straggler: rank {r.rank} on {r.host} is {r.straggler_score:.1f}x as busy as the median "
        f"rank (step {r.step_time_seconds * 1e3:,.0f} ms, of which it waits "
        f"{r.collective_wait_seconds * 1e3:,.0f} ms in collectives; the others wait "
        f"{typical_wait * 1e3:,.0f} ms)"
        for r in ranks
        if r.straggler_score > factor
    ]
