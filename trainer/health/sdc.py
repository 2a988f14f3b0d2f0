"""Silent data corruption: data-parallel replicas must hold bitwise-identical state.

Under DDP every rank applies the same all-reduced gradient to the same parameters, so the
parameters and the optimizer state of all replicas are equal bit for bit. A bit flipped by
faulty memory or a miscomputing core makes one replica differ, and nothing else notices: the
gradient all-reduce keeps the ranks in step while the corrupted weight stays wrong.

The check sums the raw bit patterns of every parameter and every optimizer-state tensor
(integers, so the sum is exact and any single flipped bit changes it), gathers the two sums of
every rank and names the ranks outside the majority. It costs one read of the state and one
tiny all-gather. FSDP shards differ by design and a single process has no replica: the check
is off there. A single process has the replay check instead (replay.py): both report a
Mismatch, counted here, and the loop handles either one the same way (a rollback).
"""

import collections
import dataclasses
import enum
import socket

import torch

from trainer import distributed

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(tensors) -> int:
    """The sum of the bit patterns of `tensors`, as integers (exact, order-free)."""
    total = 0
    for t in tensors:
        t = t.detach()
        bits = t.contiguous().view(_INT_OF_SIZE[t.element_size()])
        total += int(bits.sum(dtype=torch.int64))
    return total


def state_checksums(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameters, optimizer state) bit sums of this replica."""
    params = bit_sum(model.parameters())
    state = bit_sum(
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return params, state


def odd_ones_out(sums: list) -> list[int]:
    """Indices whose value differs from the strict majority's; all of them when values differ
    and no value holds a strict majority (2 ranks that disagree: either may be wrong)."""
    counts = collections.Counter(sums)
    value, n = counts.most_common(1)[0]
    if n == len(sums):
        return []
    if n * 2 <= len(sums):
        return list(range(len(sums)))
    return [i for i, s in enumerate(sums) if s != value]


class SdcCheck(enum.Enum):
    """Which check failed; the value is what the failure means, for the log line."""

    REPLICAS = "replicas disagree on parameters or optimizer state"
    REPLAY = "a replayed step did not reproduce its parameters and optimizer state bitwise"


@dataclasses.dataclass(frozen=True)
class Mismatch:
    step: int
    ranks: list[int]  # the suspects
    hosts: list[str]
    check: SdcCheck = SdcCheck.REPLICAS

    def __str__(self) -> str:
        who = ", ".join(f"rank {r} on {h}" for r, h in zip(self.ranks, self.hosts, strict=True))
        return f"silent data corruption at step {self.step}: {self.check.value}; suspect {who}"


class SdcChecker:
    def __init__(self, every: int, checkpoint_every: int, last_step: int, enabled: bool):
        """`enabled`: the ranks hold replicas (DDP on more than one process)."""
        self.every, self.checkpoint_every, self.last_step = every, checkpoint_every, last_step
        self.enabled = enabled and every > 0
        self.host = socket.gethostname()
        self.checks = 0
        self.rollbacks = 0
        self.mismatches: dict[int, int] = {}  # rank -> checks it lost (replica or replay)

    def due(self, step: int) -> bool:
        """Every `every` steps, and on every step that ends in a checkpoint save."""
        if not self.enabled:
            return False
        saves = self.checkpoint_every and step % self.checkpoint_every == 0
        return step % self.every == 0 or bool(saves) or step == self.last_step

    def check(self, step: int, model, optimizer) -> Mismatch | None:
        """Compare every replica (a collective: all ranks call it on the same steps)."""
        self.checks += 1
        gathered = distributed.gather_objects((state_checksums(model, optimizer), self.host))
        suspects = odd_ones_out([sums for sums, _ in gathered])
        if not suspects:
            return None
        return self.record(Mismatch(step, suspects, [gathered[r][1] for r in suspects]))

    def record(self, mismatch: Mismatch) -> Mismatch:
        """Count a lost check against each suspect rank (any check: one account)."""
        for rank in mismatch.ranks:
            self.mismatches[rank] = self.mismatches.get(rank, 0) + 1
        return mismatch


def flip_bit(model: torch.nn.Module, bit: int = 22) -> str:
    """Fault injection: flip bit `bit` of the first element of the first parameter (bit 22 of
    an fp32 is the top of the mantissa: the value changes by up to half, finite, no NaN)."""
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        flat = param.data.view(-1)[:1].view(_INT_OF_SIZE[param.element_size()])
        flat ^= 1 << bit
    return name
