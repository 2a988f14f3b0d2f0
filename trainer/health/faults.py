"""Fault injection, for tests and the reliability guide only: never set in production.

    KITCHEN_FAULTS="slow:1:0.2"       rank 1 spends 0.2 s more on every step's compute
    KITCHEN_FAULTS="slowdata:0:0.2"   rank 0 waits 0.2 s more for every step's batches (a slow
                                      data loader: what a profile's data-loader wait shows)
    KITCHEN_FAULTS="bitflip:2:5"      after step 5, rank 2 flips one bit of one weight
    KITCHEN_FAULTS="block:3:4"        rank 3 stops for good at the start of step 4
    KITCHEN_FAULTS="replayflip:0:6"   rank 0 flips one weight bit in the first of the two
                                      runs of replay-checked step 6 (the replay is clean)
    KITCHEN_FAULTS="nanloss:0:5"      step 5's loss is non-finite on every rank (once: a step
                                      replayed after a rollback is clean); repeatable

Several faults are separated by commas. Read from the environment (not the job config) so no
job spec can carry one; the trainer logs every fault it was given.
"""

import dataclasses
import enum
import os
import time

from protos.config_yaml import ConfigError

ENV = "KITCHEN_FAULTS"


class FaultKind(enum.Enum):
    SLOW = "slow"  # value: extra seconds of compute per step
    SLOW_DATA = "slowdata"  # value: extra seconds reading each step's batches
    BITFLIP = "bitflip"  # value: the step after which one weight bit flips
    BLOCK = "block"  # value: the step at whose start the rank stops
    REPLAY_BITFLIP = "replayflip"  # value: the replay-checked step whose first run is corrupted
    NAN_LOSS = "nanloss"  # value: a step whose loss the loss guard sees as NaN (any rank's fault)


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int
    value: float

    def __str__(self) -> str:
        what = {
            FaultKind.SLOW: f"{self.value:g} s more compute per step",
            FaultKind.SLOW_DATA: f"{self.value:g} s more reading each step's batches",
            FaultKind.BITFLIP: f"one weight bit flipped after step {self.value:g}",
            FaultKind.BLOCK: f"blocked for good at the start of step {self.value:g}",
            FaultKind.REPLAY_BITFLIP: (
                f"one weight bit flipped in the first run of replay-checked step {self.value:g}"
            ),
            FaultKind.NAN_LOSS: f"a non-finite loss at step {self.value:g}",
        }[self.kind]
        return f"rank {self.rank}: {what}"


def parse(text: str) -> list[Fault]:
    """`kind:rank:value[,...]`; a bad item raises ConfigError naming KITCHEN_FAULTS."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        kinds = ", ".join(k.value for k in FaultKind)
        if len(parts) != 3 or parts[0] not in {k.value for k in FaultKind}:
            raise ConfigError(ENV, f"{item!r} is not kind:rank:value with kind one of {kinds}")
        try:
            rank, value = int(parts[1]), float(parts[2])
        except ValueError:
            raise ConfigError(ENV, f"{item!r}: rank must be an integer, value a number") from None
        if rank < 0 or value < 0:
            raise ConfigError(ENV, f"{item!r}: rank and value must not be negative")
        faults.append(Fault(FaultKind(parts[0]), rank, value))
    return faults


def parse_env() -> list[Fault]:
    return parse(os.environ.get(ENV, ""))


class Injector:
    """The faults of one rank."""

    def __init__(self, faults: list[Fault], rank: int):
        self.mine = [f for f in faults if f.rank == rank]
        # A loss is every rank's (an all-reduced mean): a NAN_LOSS fault of any rank applies.
        self.nan_steps = {int(f.value) for f in faults if f.kind is FaultKind.NAN_LOSS}
        self.flipped = False  # a bit flips once, not again when a rollback replays the step
        self.replay_flipped = False

    @classmethod
    def from_env(cls, rank: int) -> "Injector":
        return cls(parse_env(), rank)

    def _value(self, kind: FaultKind) -> float | None:
        return next((f.value for f in self.mine if f.kind is kind), None)

    def before_step(self, step: int) -> None:
        """At the start of `step` (1-based): a BLOCK fault never returns."""
        if self._value(FaultKind.BLOCK) == step:
            while True:
                time.sleep(3600)

    def before_data(self) -> None:
        """While a step's batches are read."""
        if seconds := self._value(FaultKind.SLOW_DATA):
            time.sleep(seconds)

    def before_compute(self) -> None:
        if seconds := self._value(FaultKind.SLOW):
            time.sleep(seconds)

    def flip_due(self, step: int) -> bool:
        """True once, after `step` if a BITFLIP is set for it."""
        if self.flipped or self._value(FaultKind.BITFLIP) != step:
            return False
        self.flipped = True
        return True

    def replay_flip_due(self, step: int) -> bool:
        """True once, for the first run of replay-checked `step` if a REPLAY_BITFLIP is set."""
        if self.replay_flipped or self._value(FaultKind.REPLAY_BITFLIP) != step:
            return False
        self.replay_flipped = True
        return True

    def loss(self, step: int, loss: float) -> float:
        """`loss`, or NaN once for a step a NAN_LOSS fault names."""
        if step in self.nan_steps:
            self.nan_steps.discard(step)
            return float("nan")
        return loss
