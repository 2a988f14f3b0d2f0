"""The training loop's checkpoints: what `Trainer` (loop.py) saves, restores on a resume or a
rollback, and starts from; checkpoint.py is the format and its files."""

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from protos import job_pb2, trainer_config_pb2
from trainer import checkpoint
from trainer.distributed import DistEnv
from trainer.grad_noise import GradientNoiseScale
from trainer.loss_guard import LossGuard
from trainer.metrics import Goodput

if TYPE_CHECKING:
    from trainer.parallel.engine import Engine
    from trainer.recipe import Batches, Recipe


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss diverged with no checkpoint to roll back to)."""


class LoopCheckpoints:
    """Save and restore of a `Trainer`'s state; the attributes below are the Trainer's."""

    cfg: trainer_config_pb2.TrainerConfig
    kind: job_pb2.JobKind
    env: DistEnv
    log: Callable[[str], None]
    dataset_path: str
    vocab_size: int
    device: torch.device
    parallelism: str
    model: torch.nn.Module
    engine: "Engine | None"
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    loader: "Batches"
    recipe: "Recipe"
    started: str
    loader_position: dict
    checkpointer: checkpoint.Checkpointer
    guard: LossGuard
    noise: GradientNoiseScale
    goodput: Goodput
    step: int
    tokens_total: int
    restore_s: float

    def train_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(self.device),
            "guard": self.guard.state_dict(),
            "noise": self.noise.state_dict(),
            "goodput": self.goodput.state_dict(),
            "tokens_total": self.tokens_total,
            "grad_scaler": self.scaler.state_dict(),  # {} unless fp16
            "recipe": self.recipe.state_dict(),
        }

    def save(self) -> Path:
        """The checkpoint written (under a model-parallel layout, with every rank's shards)."""
        start = time.perf_counter()
        run = checkpoint.TrainingRun(
            kind=job_pb2.JobKind.Name(self.kind),
            model=self.recipe.model_config,
            vocab_size=self.vocab_size,
            dataset=self.dataset_path,
            world_size=self.env.world_size,
        )
        path = self.checkpointer.save(
            self.step,
            self.model,
            self.optimizer,
            self.train_state(),
            self.loader_position,
            run,
            mesh=self.engine.mesh if self.engine else None,
        )
        self.goodput.add("checkpoint_save", time.perf_counter() - start)
        self.goodput.checkpointed()
        return path

    def restore(
        self,
        path: Path,
        meta: checkpoint.CheckpointMeta,
        *,
        rollback: bool = False,
        badput: str = "lost",
    ) -> None:
        """Load checkpoint `path`. A resume also restores the data position and RNG; a
        rollback keeps the loader where it is, so the batches that caused it are skipped.
        `badput`: the goodput bucket the rolled-back progress goes to."""
        start = time.perf_counter()
        # The same checkpoint resumes under another layout (trainer/parallel/dcp.py): the
        # loader's position is re-expressed for this run's data-parallel ranks.
        try:
            position = self.loader.resume_state(meta.loader)
            state = checkpoint.load(
                path, self.model, self.optimizer, self.env.rank, sharded=self.engine is not None
            )
        except (ValueError, checkpoint.CheckpointError) as e:
            raise TrainingError(f"{path}: {e}") from e
        if meta.world_size != self.env.world_size:
            self.log(
                f"{path}: written by {meta.world_size} processes, resumed by "
                f"{self.env.world_size} ({self.parallelism})"
            )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = meta.step
        if rollback:
            counters = self.guard.skipped, self.guard.rollbacks
            self.guard.load_state_dict(state["guard"])
            self.guard.skipped, self.guard.rollbacks = counters
            self.goodput.rolled_back(badput)
        else:
            self.loader.load_state_dict(position)
            checkpoint.set_rng_state(state["rng"], self.device)
            self.guard.load_state_dict(state["guard"])
            self.noise.load_state_dict(state["noise"])
            self.goodput.resume(state["goodput"])
            self.tokens_total = state["tokens_total"]
            if state.get("grad_scaler"):
                self.scaler.load_state_dict(state["grad_scaler"])
            self.recipe.load_state_dict(state.get("recipe", {}))
        self.loader_position = self.loader.state_dict()
        self.restore_s += time.perf_counter() - start
        self.goodput.add("checkpoint_restore", time.perf_counter() - start)

    def resume_or_init(self) -> None:
        """Continue from the newest valid checkpoint of this run, else from what the recipe
        loaded (an SFT, RL or distill run's `checkpoint.path`), else from the seeded
        initialization."""
        if self.cfg.checkpoint.resume:
            found = self.checkpointer.find(warn=self.log)
            if found:
                self.restore(*found)
                self.log(f"resumed from {found[0]} (step {self.step})")
                return
        if self.started:
            self.log(self.started)
