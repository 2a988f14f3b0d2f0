"""Replayed steps: silent data corruption caught on a single process.

On CPU in fp32 a training step is a pure function of what it reads: the parameters, the
optimizer state, the learning-rate schedule, the loss scale, the RNG state and the batch. Run
it twice from the same state and the results agree bit for bit, so when they do not, the
hardware computed something wrong. Every `replay_check_every` steps the trainer snapshots that
state, runs the step, keeps the checksums of the parameters and the optimizer state
(sdc.state_checksums), restores the snapshot, runs the step again and compares. The second
run's result is the one training keeps, so a clean check changes nothing. Under DDP every rank
replays (the gradient all-reduce runs twice) and the ranks exchange their verdicts, so all of
them agree on the Mismatch and roll back together, exactly as after a failed replica check.

What it catches: a fault that strikes while a checked step computes (a miscomputed value, a bit
flipped in memory the step writes). What it does not: state corrupted at rest before the
snapshot, which both runs inherit (under DDP the replica check sees that), nor a fault in an
unchecked step. Cost: a checked step costs two steps, plus one copy of the model and optimizer
state held while it runs (every 100 steps: about 1% more compute).

Where a step is legitimately not bitwise reproducible, a mismatch would not mean corruption:
low-precision autocast and GPU kernels (atomics, reduction orders picked at run time), and the
layouts this check was not built for. There the trainer refuses the field rather than raise
false alarms or silently check nothing.
"""

import copy
import dataclasses
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from protos.config_yaml import ConfigError
from trainer import distributed
from trainer.health.collectives import TRACKER
from trainer.health.sdc import Mismatch, SdcCheck, state_checksums

FIELD = "trainer.health.replay_check_every"
LAYOUTS = ("SINGLE", "DDP")  # where a replayed step is a pure function of the snapshot
T = TypeVar("T")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, /) -> Any: ...


def refusal(device: torch.device, dtype: torch.dtype, parallelism: str) -> str | None:
    """Why a replayed step cannot be expected to reproduce bitwise here, or None."""
    if device.type != "cpu":
        return (
            f"a replayed step reproduces bitwise only on CPU; on {device.type} kernels may "
            "reduce in a different order on each run, so a mismatch would not mean corruption"
        )
    if dtype != torch.float32:
        return f"a replayed step is checked in fp32 only; this run computes in {dtype}"
    if parallelism not in LAYOUTS:
        return f"replay checks run under {' or '.join(LAYOUTS)}, not {parallelism}"
    return None


@dataclasses.dataclass
class Snapshot:
    """Deep copies of everything a step reads and writes (the batch is the caller's)."""

    states: list[dict]
    rng: torch.Tensor

    @classmethod
    def take(cls, stateful: Sequence[Stateful]) -> "Snapshot":
        return cls([copy.deepcopy(s.state_dict()) for s in stateful], torch.get_rng_state())

    def restore(self, stateful: Sequence[Stateful]) -> None:
        for obj, state in zip(stateful, self.states, strict=True):
            obj.load_state_dict(state)
        torch.set_rng_state(self.rng)


class ReplayChecker:
    def __init__(self, every: int, device: torch.device, dtype: torch.dtype, parallelism: str):
        """`every`: trainer.health.replay_check_every (0: off); refused where a step is not
        bitwise reproducible (ConfigError naming the field)."""
        if every and (why := refusal(device, dtype, parallelism)):
            raise ConfigError(FIELD, f"{why}; set it to 0 here")
        self.every = every
        self.host = socket.gethostname()
        self.checks = 0
        # DDP regroups its gradient buckets after its first backward, which changes the order
        # of the all-reduce's sums: the first step a DDP process runs does not reproduce (seen
        # on 4 ranks at replay_check_every 1), so it is never checked.
        self.cold = parallelism == "DDP"

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) is checked; called once per step, in order."""
        due = self.every > 0 and step % self.every == 0 and not self.cold
        self.cold = False
        return due

    def run(
        self,
        step: int,
        update: Callable[[], T],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        others: Sequence[Stateful],
        corrupt_first: Callable[[], None] | None = None,
    ) -> tuple[T, Mismatch | None]:
        """Run `update` (step `step`, 1-based) twice from one snapshot of the model, the
        optimizer, `others` and the RNG; the second run's result, and a Mismatch naming every
        rank whose two runs differ (a collective under DDP: every rank checks the same steps).
        `corrupt_first`: fault injection, called before the first run only."""
        stateful = [model, optimizer, *others]
        snapshot = Snapshot.take(stateful)
        if corrupt_first is not None:
            corrupt_first()
        update()
        TRACKER.end_step()  # count the first run's exposed DDP wait too (the straggler score)
        first = state_checksums(model, optimizer)
        snapshot.restore(stateful)
        result = update()
        differs = state_checksums(model, optimizer) != first
        self.checks += 1
        gathered = distributed.gather_objects((differs, self.host))
        suspects = [rank for rank, (bad, _) in enumerate(gathered) if bad]
        if not suspects:
            return result, None
        hosts = [gathered[rank][1] for rank in suspects]
        return result, Mismatch(step, suspects, hosts, SdcCheck.REPLAY)
