"""The one object the training loop talks to about health: it times each step for the
straggler score, runs the replica and replay checks when due, feeds the watchdog, injects test
faults."""

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from protos import progress_pb2, trainer_config_pb2
from trainer import distributed
from trainer.config import train_dtype
from trainer.distributed import DistEnv
from trainer.health import faults, replay, sdc
from trainer.health.collectives import TRACKER
from trainer.health.stragglers import StragglerMonitor, describe_stragglers
from trainer.health.watchdog import Watchdog

T = TypeVar("T")


def _store():
    """The process group's key-value store (torchrun's TCPStore), or None on one process."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.distributed_c10d._get_default_store()


class HealthMonitor:
    def __init__(
        self,
        cfg: trainer_config_pb2.TrainerConfig,
        env: DistEnv,
        parallelism: str,
        run_dir: Path,
        log: Callable[[str], None],
    ):
        h = cfg.health
        self.factor = h.straggler_factor
        self.log = log
        self.stragglers = StragglerMonitor(env.rank, TRACKER)
        replicated = parallelism == "DDP" and env.world_size > 1
        self.sdc = sdc.SdcChecker(
            h.sdc_check_every, cfg.checkpoint.every_steps, cfg.train.steps, replicated
        )
        self.replay = replay.ReplayChecker(
            h.replay_check_every, env.device, train_dtype(cfg, env.device), parallelism
        )
        self.replayed: sdc.Mismatch | None = None  # a failed replay, until check_sdc reports it
        self.watchdog = Watchdog(
            run_dir, env.rank, env.world_size, h.hang_timeout_seconds, TRACKER, _store(), log
        )
        if self.sdc.enabled:
            checks = f"replica checks every {h.sdc_check_every} steps and before each checkpoint"
        elif not replicated:
            checks = f"replica checks off ({parallelism}: no replicas to compare)"
        else:
            checks = "replica checks off (health.sdc_check_every 0)"
        if self.replay.every:
            checks += (
                f"; replay checks every {h.replay_check_every} steps (a checked step runs twice)"
            )
        watchdog = f"{h.hang_timeout_seconds:g} s" if h.hang_timeout_seconds else "off"
        log(
            f"health: {checks}; hang watchdog {watchdog}; stragglers logged above "
            f"{self.factor:g}x the median rank's busy time"
        )
        self.faults = faults.Injector.from_env(env.rank)
        injected = faults.parse_env()
        for fault in injected:
            log(f"fault injection ({faults.ENV}): {fault}")

    def start(self) -> None:
        self.watchdog.start()

    def stop(self) -> None:
        self.watchdog.stop()

    def step_started(self, step: int) -> None:
        """`step`: the 1-based step about to run."""
        self.faults.before_step(step)
        self.stragglers.begin_step()

    def before_compute(self) -> None:
        self.faults.before_compute()

    def step_ended(self, step: int, step_s: float, data_s: float, model) -> None:
        self.stragglers.end_step(step_s, data_s)
        self.watchdog.beat(step)
        if self.faults.flip_due(step):
            self._flip_bit(model, f"after step {step}")

    @staticmethod
    def _flip_bit(model: torch.nn.Module, when: str) -> None:
        name = sdc.flip_bit(distributed.unwrap(model))
        print(f"fault injection: flipped a bit of {name} {when}", flush=True)

    def run_step(
        self,
        step: int,
        update: Callable[[], T],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        others: Sequence[replay.Stateful],
    ) -> T:
        """`update()`: the step's compute and update (step `step`, 1-based), run once, or
        twice from one snapshot when a replay check is due (`others`: the rest of the state
        it changes). A replay that differs is reported by the next check_sdc."""
        if not self.replay.due(step):
            return update()
        corrupt = None
        if self.faults.replay_flip_due(step):
            corrupt = functools.partial(self._flip_bit, model, f"in step {step}'s first run")
        result, self.replayed = self.replay.run(step, update, model, optimizer, others, corrupt)
        return result

    def check_sdc(self, step: int, model, optimizer: torch.optim.Optimizer):
        """A Mismatch when this step's replay differed or the replicas disagree (the caller
        rolls back), else None. Every rank reaches the same verdict on the same steps."""
        mismatch, self.replayed = self.replayed, None
        if mismatch is not None:
            return self.sdc.record(mismatch)
        if not self.sdc.due(step):
            return None
        return self.sdc.check(step, model, optimizer)

    def rank_report(self) -> list[progress_pb2.RankHealth]:
        """Every rank's timings since the last report (a collective); logs stragglers."""
        ranks = self.stragglers.report(self.sdc.mismatches)
        for line in describe_stragglers(ranks, self.factor):
            self.log(line)
        return ranks

    def counters(self) -> dict:
        checks = self.sdc.checks + self.replay.checks
        return {"sdc_checks": checks, "sdc_rollbacks": self.sdc.rollbacks}
