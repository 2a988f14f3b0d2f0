"""The training loop: pretrain and SFT on packed rows, one code path for 1 or N processes.

A step: read `grad_accum` micro-batches, agree across ranks on how many tokens carry a label
(the loss is the mean over every labelled token of the global batch, however they are split
into micro-batches and ranks), forward and backward each micro-batch (gradients all-reduced on
the last), clip, let the loss guard veto the update, step the optimizer and the schedule.
"""

import contextlib
import enum
import math
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from protos import job_pb2, layout, trainer_config_pb2
from protos.enums import enum_name
from trainer import checkpoint, distributed, evaluate, expert_parallel, fp8, moe
from trainer.config import train_dtype
from trainer.distributed import DistEnv
from trainer.grad_noise import GradientNoiseScale, MicroBatchGradNorm
from trainer.health.monitor import HealthMonitor
from trainer.loss_guard import LossGuard, Verdict
from trainer.metrics import Goodput, MetricsLogger, peak_memory_bytes, process_start_time
from trainer.model import Transformer, attention_layout, select_ops
from trainer.optim import build_optimizer, build_scheduler
from trainer.sizing import flops


def trainer_parallel_wire():
    """trainer.parallel.wire, imported when a model-parallel layout first needs it."""
    from trainer.parallel import wire

    return wire


class Outcome(enum.Enum):
    """How `Trainer.run` ended; the value is the phase of the run's last progress record."""

    DONE = "done"  # trained to train.steps
    PREEMPTED = "preempted"  # a stop was requested: a checkpoint was saved, the job may resume


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss diverged with no checkpoint to roll back to)."""


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def build_model(
    cfg: trainer_config_pb2.TrainerConfig,
    vocab_size: int,
    device: torch.device,
    recompute: str = "NONE",
) -> Transformer:
    """The Transformer of a resolved config, initialized from `train.seed`, on `device`."""
    seed_everything(cfg.train.seed)
    ops = select_ops(cfg.model.use_kernels, device)
    return Transformer(cfg.model, vocab_size, ops=ops, recompute=recompute).to(device)


class Trainer:
    def __init__(
        self,
        cfg: trainer_config_pb2.TrainerConfig,
        kind: job_pb2.JobKind,
        run_dir: str | Path,
        env: DistEnv,
        dataset_path: str | Path,
        vocab_size: int,
        *,
        log: Callable[[str], None],
    ):
        """`cfg`: resolved (protos.validation.resolve_trainer); `kind`: PRETRAIN or SFT."""
        from trainer.data.loader import PackedRowLoader

        self.cfg, self.kind, self.env, self.log = cfg, kind, env, log
        self.run_dir, self.dataset_path = Path(run_dir), str(dataset_path)
        self.device, self.dtype = env.device, train_dtype(cfg, env.device)
        t = cfg.train
        self.parallelism = enum_name(t, "parallelism")
        if env.world_size == 1:
            self.parallelism = "SINGLE"
        self.vocab_size = vocab_size
        model = build_model(cfg, vocab_size, self.device, enum_name(t, "recompute"))
        if fp8.enabled(cfg):  # #20: the blocks' Linear layers in float8 (CUDA 8.9+ only)
            swapped = fp8.convert(model, fp8.backend_for(self.device))
            log(f"fp8: {len(swapped)} Linear layers compute in float8 (tensorwise scaling)")
        self.flops_per_token = flops.flops_per_token(
            model.matmul_params(),
            cfg.model.n_layers,
            cfg.model.n_heads,
            cfg.model.dim // cfg.model.n_heads,
            cfg.data.seq_len,
        )
        # Counted whole, before a pipeline layout keeps only this rank's stages.
        n_params, n_matmul = sum(p.numel() for p in model.parameters()), model.matmul_params()
        if t.compile:
            for block in model.layers:
                block.compile()
        # Tensor/pipeline/context parallel (trainer/parallel): the engine runs the step; ranks
        # of one data-parallel group read the same rows.
        self.layout = layout.from_train(t, env.world_size)
        self.engine = None
        data_rank, data_ranks = env.rank, env.world_size
        if self.layout.model_parallel:
            from trainer.parallel import mesh
            from trainer.parallel.engine import Engine

            lay_mesh = mesh.build(self.layout, self.device)
            self.engine = Engine(model, lay_mesh, t.grad_accum, self.dtype)
            data_rank, data_ranks = lay_mesh.rank("dp"), self.layout.dp
            self.parallelism = self.layout.describe()
            self.model = model
        elif self.parallelism == "EXPERT":
            ep = t.expert_parallel or env.world_size
            self.model = expert_parallel.wrap(model, env, ep)
        else:
            self.model = distributed.wrap(model, self.parallelism, env, self.dtype)
        self.copies = env.world_size // data_ranks  # ranks that read the same rows
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        # fp16's 5 exponent bits underflow small gradients: the loss is scaled up before
        # backward and the gradients down before the update, and a step whose gradients
        # overflowed is skipped while the scale halves. bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.loader = PackedRowLoader(
            self.dataset_path,
            split="train",
            batch_size=t.micro_batch,
            seed=t.seed,
            rank=data_rank,
            world_size=data_ranks,
        )
        # Where the next step's batches start: what a checkpoint records. A preemption noticed
        # after this step's batches were read saves the position before them.
        self.loader_position = self.loader.state_dict()
        self.checkpointer = checkpoint.Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint.keep_last, env.is_main
        )
        self.guard = LossGuard(t.spike_factor, t.max_bad_steps)
        self.noise = GradientNoiseScale()
        self.health = HealthMonitor(cfg, env, self.parallelism, self.run_dir, log)
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
        ops = "Triton kernels" if model.ops.__name__ == "kernels" else "PyTorch reference ops"
        log(
            f"model: {n_params / 1e6:.2f} M parameters "
            f"({n_matmul / 1e6:.2f} M in matmuls), {ops}, {self.dtype}, "
            f"{self.parallelism} on {env.world_size} x {self.device.type}, "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token, "
            f"peak {self.metrics.peak / 1e12:.3g} TFLOP/s ({self.metrics.basis})"
        )

    # ------------------------------------------------------------------ checkpoints

    def train_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(self.device),
            "guard": self.guard.state_dict(),
            "noise": self.noise.state_dict(),
            "goodput": self.goodput.state_dict(),
            "tokens_total": self.tokens_total,
            "grad_scaler": self.scaler.state_dict(),  # {} unless fp16
        }

    def save(self) -> Path:
        """The checkpoint written (under a model-parallel layout, with every rank's shards)."""
        start = time.perf_counter()
        run = checkpoint.TrainingRun(
            kind=job_pb2.JobKind.Name(self.kind),
            model=self.cfg.model,
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
        from trainer.data.loader import resharded

        start = time.perf_counter()
        # The same checkpoint resumes under another layout (trainer/parallel/dcp.py): the
        # loader's position is re-expressed for this run's data-parallel ranks.
        try:
            position = resharded(meta.loader[0], self.loader.world_size, self.loader.rank)
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
            set_rng_state(state["rng"], self.device)
            self.guard.load_state_dict(state["guard"])
            self.noise.load_state_dict(state["noise"])
            self.goodput.resume(state["goodput"])
            self.tokens_total = state["tokens_total"]
            if state.get("grad_scaler"):
                self.scaler.load_state_dict(state["grad_scaler"])
        self.loader_position = self.loader.state_dict()
        self.restore_s += time.perf_counter() - start
        self.goodput.add("checkpoint_restore", time.perf_counter() - start)

    def resume_or_init(self) -> None:
        """Continue from the newest valid checkpoint of this run, else (SFT) start from
        `checkpoint.path`, else from the seeded initialization."""
        if self.cfg.checkpoint.resume:
            found = self.checkpointer.find(warn=self.log)
            if found:
                self.restore(*found)
                self.log(f"resumed from {found[0]} (step {self.step})")
                return
        if self.kind == job_pb2.SFT and self.cfg.checkpoint.path:
            path = Path(self.cfg.checkpoint.path)
            meta = checkpoint.pretrained(path, self.cfg.model, self.vocab_size)
            state = torch.load(path / "model.pt", map_location="cpu", mmap=True)
            checkpoint.load_model_state(self.model, state)
            self.log(f"fine-tuning from {path} (step {meta.step})")

    # ------------------------------------------------------------------ one step

    def _micro_batches(self) -> list[dict]:
        return [next(self.loader) for _ in range(self.cfg.train.grad_accum)]

    def train_step(self, batches: list[dict], n_tokens: float) -> tuple[float, float]:
        """Forward/backward every micro-batch, then clip; returns (mean loss, grad norm).
        `n_tokens`: labelled tokens in the global batch (all micro-batches, all ranks)."""
        if self.engine is not None:
            share = self.engine.forward_backward(batches, n_tokens)
            grad_norm = self.engine.clip(self.cfg.optim.grad_clip)
            return float(distributed.all_reduce_sum(share.view(1))[0]) / n_tokens, grad_norm
        accum, world = len(batches), self.env.world_size
        autocast = torch.autocast(
            self.device.type,
            dtype=self.dtype,
            enabled=self.dtype != torch.float32 and self.parallelism != "FSDP",
        )
        # Per-micro-batch gradient norms feed the noise scale (grad_noise.py, under DDP and
        # FSDP alike); one micro-batch on one rank has no smaller batch to compare with.
        measure_noise = accum > 1
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        small = torch.zeros(2, device=self.device, dtype=torch.float64)
        for k, b in enumerate(batches):
            layout = attention_layout(b["document_ids"], self.device, self.dtype)
            b = {key: v.to(self.device, non_blocking=True) for key, v in b.items()}
            with distributed.gradient_sync(self.model, k == accum - 1), autocast:
                loss = self.model(b["input_ids"], b["position_ids"], layout, b["labels"])
            probe = MicroBatchGradNorm(loss) if k == 0 and measure_noise else None
            self.scaler.scale(loss * (world / n_tokens)).backward()
            loss_sum += loss.detach()
            if probe is not None:
                n_small = float((b["labels"] != -100).sum())
                # The accumulated gradient is sum-loss * world / n_tokens: rescale to a mean.
                scale = n_tokens / (world * max(n_small, 1.0))
                # Under fp16 the gradients are still multiplied by the loss scale here.
                small[0] = probe.close() * (scale / self.scaler.get_scale()) ** 2
                small[1] = n_small
        totals = distributed.all_reduce_sum(torch.cat([loss_sum.view(1), small]))
        clip = self.cfg.optim.grad_clip or math.inf
        self.scaler.unscale_(self.optimizer)  # clip the true gradients (no-op unless fp16)
        if isinstance(self.model, expert_parallel.ExpertParallel):  # a norm over all experts
            grad_norm = self.model.clip_grad_norm_(clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if measure_noise:
            self.noise.update(
                float(totals[1]) / world, float(totals[2]) / world, grad_norm**2, n_tokens
            )
        return float(totals[0]) / n_tokens, grad_norm

    # ------------------------------------------------------------------ the loop

    def run(self) -> Outcome:
        """Train to `train.steps`, or until a stop is requested (a checkpoint is saved)."""
        self.goodput.add("startup", time.time() - self.goodput.started - self.restore_s)
        self.metrics.identity["total_steps"] = self.cfg.train.steps
        first_step = self.step
        self.health.start()
        try:
            while self.step < self.cfg.train.steps:
                if self.advance(first_step) is Outcome.PREEMPTED:
                    return Outcome.PREEMPTED
        finally:
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
        labelled = sum(int((b["labels"] != -100).sum()) for b in batches)
        padding = sum(int((b["document_ids"] < 0).sum()) for b in batches)
        local = [labelled, padding, int(self.stop_requested())]
        agreed = distributed.all_reduce_sum(
            torch.tensor(local, dtype=torch.float64, device=self.device)
        ).tolist()
        agreed[:2] = [x / self.copies for x in agreed[:2]]  # rows read by several ranks
        if agreed[2] > 0:
            path = self.save()
            self.log(f"stop requested: saved {path} at step {self.step}; exiting")
            return Outcome.PREEMPTED
        self.health.before_compute()
        # Under a model-parallel layout, logged steps also time the collectives (each waited
        # for where it is issued: the logged step runs without overlap; the others are free).
        logs = self._logs(self.step + 1, first_step)
        timed = trainer_parallel_wire().WireCounter() if self.engine and logs else None
        # A replay check (trainer/health/replay.py) runs the update twice from one snapshot.
        loss, grad_norm, verdict, lr = self.health.run_step(
            self.step + 1,
            lambda: self._update(batches, max(agreed[0], 1.0), timed),
            self.model,
            self.optimizer,
            (self.scheduler, self.scaler, self.guard, self.noise),
        )
        self.step += 1
        self.loader_position = self.loader.state_dict()
        step_s = time.perf_counter() - start
        self.health.step_ended(self.step, step_s, data_s, distributed.unwrap(self.model))
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
        positions = sum(b["document_ids"].numel() for b in batches) * (
            self.env.world_size // self.copies
        )
        tokens = positions - int(agreed[1])
        self.tokens_total += tokens
        self.metrics.step(
            tokens=tokens,
            positions=positions,
            padding=int(agreed[1]),
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
        n_tokens: float,
        timed: contextlib.AbstractContextManager | None,
    ) -> tuple[float, float, Verdict, float]:
        """The step's compute and update: (loss, grad norm, verdict, lr). It changes the model,
        the optimizer, the schedule, the loss scale, the loss guard and the noise scale (what
        HealthMonitor.run_step snapshots for a replay), and MoE routing statistics (a metric;
        a replayed step counts them twice)."""
        with timed or contextlib.nullcontext():
            loss, grad_norm = self.train_step(batches, n_tokens)
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

    def _logs(self, step: int, first_step: int) -> bool:
        """Whether step `step` (1-based) is reported."""
        t = self.cfg.train
        return step % t.log_every == 0 or step in (first_step + 1, t.steps)

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
        )
        self.log(self.metrics.human_line(p))

    def evaluate(self) -> float:
        if self.layout.pp > 1 or self.layout.cp > 1:
            self.log(f"eval: not run under {self.layout.describe()} (pipeline/context parallel)")
            return math.nan
        start = time.perf_counter()
        result = evaluate.heldout_loss(
            self.model, self.dataset_path, self.cfg, self.env, self.dtype
        )
        self.goodput.add("eval", time.perf_counter() - start)
        if result is None:
            self.log("eval: the held-out split is empty; no eval loss")
            return math.nan
        message = (
            f"eval at step {self.step}: loss {result.loss:.4f}, perplexity "
            f"{result.perplexity:,.2f} over {result.tokens:,} held-out tokens"
        )
        self.log(message)
        score = {"task": "heldout", "metric": "loss", "value": result.loss}  # kitchen_eval_score
        self.metrics.write(
            self._progress(
                phase="eval", eval_loss=result.loss, message=message, eval_scores=[score]
            )
        )
        return result.loss


def install_sigterm_handler() -> Callable[[], bool]:
    """SIGTERM (a preemption) sets a flag the loop checks between steps; returns the check."""
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    return lambda: bool(received)
