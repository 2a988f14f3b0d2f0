"""The training loop: the one core every training kind runs on, for 1 or N processes.

What differs between kinds is the recipe's (trainer/recipe.py: the model, its batches, its loss,
its evaluation; trainer/recipes/ has one per kind). A step: read `grad_accum` micro-batches,
agree across ranks on how many units (labelled tokens, pairs, ...) the loss covers (it is the
mean over every unit of the global batch, however they are split into micro-batches and ranks),
forward and backward each micro-batch (gradients all-reduced on the last), clip, let the loss
guard veto the update, step the optimizer and the schedule.

What the loop is built on and delegates to lies beside it: model_setup.py (the model, its
parallel wrapping, optimizer and schedule), step.py (the step's compute and token accounting),
loop_checkpoint.py (save, resume, rollback restore).
"""

import contextlib
import enum
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from trainer import checkpoint, model_setup, moe
from trainer.distributed import unwrap
from trainer.grad_noise import GradientNoiseScale
from trainer.health.monitor import HealthMonitor
from trainer.loop_checkpoint import LoopCheckpoints, TrainingError
from trainer.loss_guard import LossGuard, Verdict
from trainer.metrics import Goodput, MetricsLogger, peak_memory_bytes, process_start_time
from trainer.recipe import BatchCounts, Recipe
from trainer.sizing import flops
from trainer.step import agree_counts, batch_positions, engine_step, is_logged, train_step
from trainer.step_profiler import StepProfiler


def trainer_parallel_wire():
    """trainer.parallel.wire, imported when a model-parallel layout first needs it."""
    from trainer.parallel import wire

    return wire


class Outcome(enum.Enum):
    """How `Trainer.run` ended; the value is the phase of the run's last progress record."""

    DONE = "done"  # trained to train.steps
    PREEMPTED = "preempted"  # a stop was requested: a checkpoint was saved, the job may resume


class Trainer(LoopCheckpoints):
    """One run of any training kind: `resume_or_init`, then `run` (loop_checkpoint.py)."""

    def __init__(self, recipe: Recipe, run_dir: str | Path, *, log: Callable[[str], None]):
        """`recipe.cfg`: resolved (protos.validation.resolve_trainer)."""
        cfg, env = recipe.cfg, recipe.env
        self.recipe = recipe
        self.cfg, self.kind, self.env, self.log = cfg, recipe.kind, env, log
        self.run_dir, self.dataset_path = Path(run_dir), str(recipe.dataset)
        self.device, self.dtype = env.device, recipe.dtype
        self.vocab_size = recipe.vocab_size
        parts = model_setup.set_up(cfg, env, recipe, self.dtype, log)
        self.bare, self.started = parts.bare, parts.started
        self.model, self.engine, self.layout = parts.model, parts.engine, parts.layout
        recipe.engine = self.engine  # a language-model recipe's eval runs on it
        self.parallelism, self.flops_per_token = parts.parallelism, parts.flops_per_token
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.scaler = parts.scaler
        self.copies = env.world_size // parts.data_ranks  # ranks that read the same rows
        t = cfg.train
        self.loader = recipe.batches(parts.data_rank, parts.data_ranks, self.bare)
        # Where the next step's batches start: what a checkpoint records. A preemption noticed
        # after this step's batches were read saves the position before them.
        self.loader_position = self.loader.state_dict()
        self.checkpointer = checkpoint.Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint.keep_last, env.is_main
        )
        spike_factor = t.spike_factor if recipe.loss_spikes_matter else math.inf
        self.guard = LossGuard(spike_factor, t.max_bad_steps)
        self.noise = GradientNoiseScale()
        self.health = HealthMonitor(cfg, env, self.parallelism, self.run_dir, log)
        self.profiler = StepProfiler(cfg.profile, self.run_dir, env, log)  # trainer.profile
        self.goodput = Goodput(process_start_time())
        self.metrics = MetricsLogger(
            self.run_dir,
            is_main=env.is_main,
            model_flops_per_token=self.flops_per_token,
            peak=flops.peak_flops_per_second(self.device, self.dtype),
            world_size=env.world_size,
            log=log,
        )
        self.step, self.tokens_total = 0, 0
        self.restore_s = 0.0  # spent restoring in this process (not start-up)
        # replaced by main: SIGTERM or the launcher
        self.stop_requested: Callable[[], bool] = lambda: False
        log(
            f"model: {parts.n_params / 1e6:.2f} M parameters "
            f"({parts.n_matmul / 1e6:.2f} M in matmuls), {parts.ops}, {self.dtype}, "
            f"{self.parallelism} on {env.world_size} x {self.device.type}, "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token, "
            f"peak {self.metrics.peak / 1e12:.3g} TFLOP/s ({self.metrics.basis})"
        )
        if recipe.describe(self.bare):
            log(recipe.describe(self.bare))

    # ------------------------------------------------------------------ one step

    def _micro_batches(self) -> list[dict]:
        with self.profiler.data_wait():
            self.health.faults.before_data()  # fault injection (tests, the guide)
            return [next(self.loader) for _ in range(self.cfg.train.grad_accum)]

    def train_step(
        self, batches: list[dict], counts: list[BatchCounts], n_tokens: float
    ) -> tuple[float, float]:
        """Forward/backward every micro-batch, then clip; returns (mean loss, grad norm).
        `n_tokens`: the loss's units in the global batch (all micro-batches, all ranks)."""
        clip = self.cfg.optim.grad_clip
        if self.engine is not None:
            return engine_step(self.engine, batches, n_tokens, clip)
        return train_step(
            self.model,
            batches,
            n_tokens,
            loss_fn=self.recipe.loss,
            units=[c.units for c in counts],
            optimizer=self.optimizer,
            scaler=self.scaler,
            noise=self.noise,
            device=self.device,
            dtype=self.dtype,
            autocast=self.parallelism != "FSDP",
            grad_clip=clip,
            world_size=self.env.world_size,
        )

    # ------------------------------------------------------------------ the loop

    def run(self) -> Outcome:
        """Train to `train.steps`, or until a stop is requested (a checkpoint is saved)."""
        self.goodput.add("startup", time.time() - self.goodput.started - self.restore_s)
        self.metrics.identity["total_steps"] = self.cfg.train.steps
        first_step = self.step
        self.health.start()
        try:
            while self.step < self.cfg.train.steps:
                with self.profiler.step(self.step + 1):
                    outcome = self.advance(first_step)
                if outcome is Outcome.PREEMPTED:
                    return Outcome.PREEMPTED
        finally:
            self.profiler.close()
            self.health.stop()
        if self.step > first_step:
            self.log(f"saved {self.save()}")
        self.evaluate()
        return Outcome.DONE

    def advance(self, first_step: int = 0) -> Outcome | None:
        """One optimizer step and what follows it (metrics, checkpoint, eval); PREEMPTED when
        a stop was requested instead. `first_step`: where this process started (logged)."""
        t, every = self.cfg.train, self.cfg.checkpoint.every_steps
        self.health.step_started(self.step + 1)
        start = time.perf_counter()
        batches = self._micro_batches()
        data_s = time.perf_counter() - start
        counts = [self.recipe.counts(b) for b in batches]
        agreed = agree_counts(counts, self.stop_requested(), self.copies, self.device)
        if agreed.stop:
            path = self.save()
            self.log(f"stop requested: saved {path} at step {self.step}; exiting")
            return Outcome.PREEMPTED
        self.health.before_compute()
        # Under a model-parallel layout, logged steps also time the collectives (each waited
        # for where it is issued: the logged step runs without overlap; the others are free).
        logs = is_logged(self.step + 1, first_step, t)
        timed = trainer_parallel_wire().WireCounter() if self.engine and logs else None
        # A replay check (trainer/health/replay.py) runs the update twice from one snapshot.
        loss, grad_norm, verdict, lr = self.health.run_step(
            self.step + 1,
            lambda: self._update(batches, counts, max(agreed.labelled, 1.0), timed),
            self.model,
            self.optimizer,
            (self.scheduler, self.scaler, self.guard, self.noise),
        )
        self.step += 1
        self.loader_position = self.loader.state_dict()
        step_s = time.perf_counter() - start
        self.health.step_ended(self.step, step_s, data_s, unwrap(self.model))
        self.goodput.add("data", data_s)
        if verdict is not Verdict.OK:
            self.goodput.add("lost", step_s - data_s)
        elif t.compile and self.step == first_step + 1:
            self.goodput.add("startup", step_s - data_s)  # mostly compiling the blocks
        else:
            self.goodput.add("productive", step_s - data_s)
        # Before this step's metrics: a step from corrupted state is rolled back, not logged.
        mismatch = self.health.check_sdc(self.step, self.model, self.optimizer)
        if verdict is Verdict.OK and mismatch is not None:
            self._sdc_rollback(mismatch)
            return None
        positions = batch_positions(counts, self.env.world_size, self.copies)
        tokens = positions - int(agreed.padding)
        self.tokens_total += tokens
        self.metrics.step(
            tokens=tokens,
            positions=positions,
            padding=int(agreed.padding),
            loss=loss if verdict is Verdict.OK else None,
            step_time=step_s,
            data_time=data_s,
        )
        if verdict is not Verdict.OK:
            self.log(f"step {self.step}: loss {loss:.4g} rejected by the loss guard")
        if verdict is Verdict.ROLLBACK:
            self._rollback()
            return None
        if logs:
            comm = timed.seconds / max(step_s - data_s, 1e-9) if timed else 0.0
            self._log_step(grad_norm, lr, comm_fraction=comm)
        if every and self.step % every == 0 and self.step < t.steps:
            self.save()
        if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
            self.evaluate()
        return None

    def _update(
        self,
        batches: list[dict],
        counts: list[BatchCounts],
        n_tokens: float,
        timed: contextlib.AbstractContextManager | None,
    ) -> tuple[float, float, Verdict, float]:
        """The step's compute and update: (loss, grad norm, verdict, lr). It changes the model,
        the optimizer, the schedule, the loss scale, the loss guard and the noise scale (what
        HealthMonitor.run_step snapshots for a replay), and MoE routing statistics (a metric;
        a replayed step counts them twice)."""
        with timed or contextlib.nullcontext():
            loss, grad_norm = self.train_step(batches, counts, n_tokens)
        loss = self.health.faults.loss(self.step + 1, loss)  # fault injection (tests)
        verdict = self.guard.check(loss)
        if verdict is Verdict.OK:
            self.scaler.step(self.optimizer)  # skipped if fp16 gradients overflowed
        self.scaler.update()
        moe.end_step(self.model, updated=verdict is Verdict.OK)  # expert bias balancing
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            # A skipped update still advances the schedule; torch warns about the order.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
            self.scheduler.step()
        return loss, grad_norm, verdict, lr

    def _rollback(self) -> None:
        found = self.checkpointer.find(warn=self.log)
        if not found:
            raise TrainingError(
                f"loss guard: {self.cfg.train.max_bad_steps} bad steps in a row at step "
                f"{self.step} and no checkpoint to roll back to (see trainer.train.spike_factor)"
            )
        bad_step = self.step
        self.restore(*found, rollback=True)
        message = f"rolled back from step {bad_step} to {found[0].name}"
        self.log(message)
        self.metrics.write(self._progress(phase="train", message=message))

    def _sdc_rollback(self, mismatch) -> None:
        """Replicas disagree, or a replayed step did not reproduce: every rank restores the
        newest checkpoint (under DDP each was checked before it was saved) and replays its
        batches; the lost time is "sdc_rollback" badput."""
        found = self.checkpointer.find(warn=self.log)
        if not found:
            raise TrainingError(f"{mismatch}; no checkpoint to roll back to")
        self.restore(*found, rollback=True, badput="sdc_rollback")
        self.loader.load_state_dict(found[1].loader[self.env.rank])
        self.loader_position = self.loader.state_dict()
        self.health.sdc.rollbacks += 1
        message = f"{mismatch}: rolled back to {found[0].name}"
        self.log(message)
        self.metrics.write(self._progress(phase="train", message=message))

    def _progress(self, **fields):
        from protos import progress_pb2

        return progress_pb2.Progress(
            step=self.step, **self.metrics.identity, **self._counters(), **fields
        )

    def _counters(self) -> dict:
        return {
            "skipped_steps": self.guard.skipped,
            "rollbacks": self.guard.rollbacks,
            "tokens_total": self.tokens_total,
            "goodput": self.goodput.fraction(),
            **self.health.counters(),
        }

    def _log_step(self, grad_norm: float, lr: float, comm_fraction: float = 0.0) -> None:
        own = self.recipe.step_fields()  # the kind's own metrics (reward, KL, image share, ...)
        p = self.metrics.emit(
            step=self.step,
            comm_fraction=comm_fraction,
            grad_norm=grad_norm,
            lr=lr,
            peak_memory_bytes=peak_memory_bytes(self.device),
            gradient_noise_scale=self.noise.value,
            ranks=self.health.rank_report(),
            **self._counters(),
            **moe.progress_fields(self.model),
            **own,
        )
        shown = ", ".join(
            f"{name.replace('_', ' ')} {value:.0%}" if name.endswith("_share") else
            f"{name.replace('_', ' ')} {value:.4g}"
            for name, value in own.items()
        )  # fmt: skip
        self.log(self.metrics.human_line(p) + (f" | {shown}" if shown else ""))

    def evaluate(self) -> float:
        """The recipe's held-out evaluation: logged, and a progress record."""
        start = time.perf_counter()
        result = self.recipe.evaluate(self.model, self.step)
        self.goodput.add("eval", time.perf_counter() - start)
        if result is None:
            return math.nan
        self.log(result.message)
        if not math.isnan(result.loss) or result.fields:
            self.metrics.write(
                self._progress(
                    phase="eval",
                    message=result.message,
                    eval_scores=result.scores,
                    **result.fields,
                )
            )
        return result.loss
