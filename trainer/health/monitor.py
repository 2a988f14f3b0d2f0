"""The one object the training loop talks to about health: it times each step for the
straggler score, runs the replica checks when due, feeds the watchdog, injects test faults."""

from collections.abc import Callable
from pathlib import Path

import torch

from protos import progress_pb2, trainer_config_pb2
from trainer.distributed import DistEnv
from trainer.health import faults, sdc
from trainer.health.collectives import TRACKER
from trainer.health.stragglers import StragglerMonitor, describe_stragglers
from trainer.health.watchdog import Watchdog


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
        self.watchdog = Watchdog(
            run_dir, env.rank, env.world_size, h.hang_timeout_seconds, TRACKER, _store(), log
        )
        if self.sdc.enabled:
            checks = f"replica checks every {h.sdc_check_every} steps and before each checkpoint"
        elif not replicated:
            checks = f"replica checks off ({parallelism}: no replicas to compare)"
        else:
            checks = "replica checks off (health.sdc_check_every 0)"
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
            name = sdc.flip_bit(model)
            print(f"fault injection: flipped a bit of {name} after step {step}", flush=True)

    def check_replicas(self, step: int, model, optimizer: torch.optim.Optimizer):
        """A Mismatch when the replicas disagree (the caller rolls back), else None."""
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
        return {"sdc_checks": self.sdc.checks, "sdc_rollbacks": self.sdc.rollbacks}
