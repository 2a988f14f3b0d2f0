"""The VLM job: train a stage (ALIGN or FINETUNE) on precooked image+text rows, then evaluate.

It reuses the text trainer's parts: AdamW and the schedule (optim.py), atomic checkpoints with
exact resume (checkpoint.py; the loader position is ImageRowLoader's), MetricsLogger and goodput
(metrics.py), the loss guard. A stage starts from, in order: this run's newest checkpoint (a
resume), `checkpoint.path` (a text checkpoint: the LM only; or a VLM checkpoint of an earlier
stage: the whole model), or the seeded initialization.
"""

import math
import time
from pathlib import Path

import torch

from protos.config_yaml import ConfigError
from protos.enums import enum_name
from protos.files import write_json_atomic
from protos.trainer_config_pb2 import TrainerConfig
from trainer import checkpoint, distributed
from trainer.config import train_dtype
from trainer.data.image_loader import ImageRowLoader
from trainer.distributed import DistEnv
from trainer.loop import Outcome
from trainer.loss_guard import LossGuard, Verdict
from trainer.metrics import Goodput, MetricsLogger, peak_memory_bytes, process_start_time
from trainer.model_setup import seed_everything
from trainer.optim import build_optimizer, build_scheduler
from trainer.sizing import flops
from trainer.step import is_logged
from trainer.vlm import evaluate
from trainer.vlm.model import VisionLanguageModel


def build_vlm(cfg: TrainerConfig, vocab_size: int, device) -> VisionLanguageModel:
    seed_everything(cfg.train.seed)
    return VisionLanguageModel(cfg, vocab_size, device, enum_name(cfg.train, "recompute")).to(
        device
    )


def load_start(model: VisionLanguageModel, path: Path, cfg: TrainerConfig, vocab_size: int) -> str:
    """Load `checkpoint.path` into `model`: a VLM checkpoint whole, a text one into the LM."""
    meta = checkpoint.pretrained(path, cfg.model, vocab_size)
    state = torch.load(path / "model.pt", map_location="cpu", mmap=True)
    if meta.kind == "VLM":
        try:
            checkpoint.load_model_state(model, state)
        except RuntimeError as e:  # another encoder or projector shape
            raise ConfigError("trainer.vision", f"does not match the VLM of {path}: {e}") from e
        return f"the VLM of {path} (step {meta.step})"
    checkpoint.load_model_state(model.lm, state)
    return f"the language model of {path} ({meta.kind}, step {meta.step})"


class VlmTrainer:
    def __init__(
        self, cfg: TrainerConfig, run_dir: Path, env: DistEnv, dataset: str, vocab_size: int, *, log
    ):
        self.cfg, self.env, self.log, self.run_dir = cfg, env, log, Path(run_dir)
        self.dataset, self.vocab_size = dataset, vocab_size
        self.device, self.dtype = env.device, train_dtype(cfg, env.device)
        t, v = cfg.train, cfg.vision
        model = build_vlm(cfg, vocab_size, self.device)
        self.stage = enum_name(v, "stage")
        self.start_from = ""
        if cfg.checkpoint.path:
            self.start_from = load_start(model, Path(cfg.checkpoint.path), cfg, vocab_size)
        self.trained = model.set_stage(self.stage, v.train_encoder)
        self.raw = model
        parallelism = "SINGLE" if env.world_size == 1 else "DDP"
        self.model = distributed.wrap(model, parallelism, env, self.dtype)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        self.loader = ImageRowLoader(
            dataset, "train", t.micro_batch, t.seed, env.rank, env.world_size
        )
        self.loader_position = self.loader.state_dict()
        stats = self.loader.data.manifest.splits["train"]
        text_per_row = (stats.text_tokens - stats.truncated_tokens) / max(stats.records, 1)
        row_tokens = model.image_tokens + text_per_row
        self.flops_per_token = model.flops_per_example(text_per_row) / row_tokens
        self.checkpointer = checkpoint.Checkpointer(
            run_dir / "checkpoints", cfg.checkpoint.keep_last, env.is_main
        )
        self.guard = LossGuard(t.spike_factor, t.max_bad_steps)
        self.goodput = Goodput(process_start_time())
        self.metrics = MetricsLogger(
            self.run_dir,
            is_main=env.is_main,
            model_flops_per_token=self.flops_per_token,
            peak=flops.peak_flops_per_second(self.device, self.dtype),
            world_size=env.world_size,
            log=log,
        )
        self.step, self.tokens_total, self.image_share = 0, 0, 0.0
        self.stop_requested = lambda: False
        params = lambda part: sum(p.numel() for p in getattr(model, part).parameters()) / 1e6
        log(
            f"VLM {self.stage}: encoder {params('encoder'):.2f} M, projector "
            f"{params('projector'):.2f} M, LM {params('lm'):.2f} M parameters; training "
            f"{', '.join(self.trained)}; {model.image_tokens} image tokens per image "
            f"({model.encoder.grid**2} patches / pixel_shuffle {v.pixel_shuffle}^2); "
            f"{self.flops_per_token / 1e6:.2f} MFLOP per token (vision included)"
        )

    def save(self) -> Path:
        start = time.perf_counter()
        run = checkpoint.TrainingRun(
            kind="VLM",
            model=self.cfg.model,
            vocab_size=self.vocab_size,
            dataset=self.dataset,
            world_size=self.env.world_size,
        )
        state = {
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(self.device),
            "guard": self.guard.state_dict(),
            "goodput": self.goodput.state_dict(),
            "tokens_total": self.tokens_total,
        }
        path = self.checkpointer.save(
            self.step, self.model, self.optimizer, state, self.loader_position, run
        )
        self.goodput.add("checkpoint_save", time.perf_counter() - start)
        self.goodput.checkpointed()
        return path

    def resume_or_init(self) -> None:
        found = self.checkpointer.find(warn=self.log) if self.cfg.checkpoint.resume else None
        if not found:
            if self.start_from:
                self.log(f"{self.stage} starts from {self.start_from}")
            return
        path, meta = found
        state = checkpoint.load(path, self.model, self.optimizer, self.env.rank)
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(meta.loader[self.env.rank])
        checkpoint.set_rng_state(state["rng"], self.device)
        self.guard.load_state_dict(state["guard"])
        self.goodput.resume(state["goodput"])
        self.step, self.tokens_total = meta.step, state["tokens_total"]
        self.loader_position = self.loader.state_dict()
        self.log(f"resumed from {path} (step {self.step})")

    def train_step(self, batches: list[dict]) -> tuple[float, float, int]:
        """(mean loss, grad norm, text tokens of the global batch: every rank's, not this
        rank's times the world size, which is only an estimate)."""
        n_local = sum(int((b["labels"] != -100).sum()) for b in batches)
        text_local = sum(int((b["input_ids"] != self.loader.pad_id).sum()) for b in batches)
        counts = torch.tensor([n_local, text_local], dtype=torch.float64, device=self.device)
        n, text = (float(c) for c in distributed.all_reduce_sum(counts))
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        # bf16 autocast on CUDA, fp32 on CPU, as the text trainer (step.py) does
        autocast = torch.autocast(
            self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )
        for k, b in enumerate(batches):
            b = {key: t.to(self.device) for key, t in b.items()}
            with distributed.gradient_sync(self.model, k == len(batches) - 1), autocast:
                loss = self.model(b["images"], b["input_ids"], b["labels"])
            (loss * (self.env.world_size / max(n, 1.0))).backward()
            loss_sum += loss.detach()
        total = float(distributed.all_reduce_sum(loss_sum.view(1))[0])
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip or math.inf)
        )
        return total / max(n, 1.0), grad_norm, int(text)

    def run(self) -> Outcome:
        t = self.cfg.train
        self.goodput.add("startup", time.time() - self.goodput.started)
        self.metrics.identity["total_steps"] = t.steps
        first = self.step
        image_tokens = self.raw.image_tokens
        while self.step < t.steps:
            if self.stop_requested():
                self.log(f"stop requested: saved {self.save()} at step {self.step}; exiting")
                return Outcome.PREEMPTED
            start = time.perf_counter()
            batches = [next(self.loader) for _ in range(t.grad_accum)]
            data_s = time.perf_counter() - start
            loss, grad_norm, text = self.train_step(batches)
            verdict = self.guard.check(loss)
            if verdict is Verdict.OK:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step += 1
            self.loader_position = self.loader.state_dict()
            step_s = time.perf_counter() - start
            self.goodput.add("data", data_s)
            self.goodput.add("productive" if verdict is Verdict.OK else "lost", step_s - data_s)
            rows = sum(len(b["input_ids"]) for b in batches) * self.env.world_size
            positions = rows * (image_tokens + self.cfg.data.seq_len)
            tokens = rows * image_tokens + text
            self.image_share = rows * image_tokens / max(tokens, 1)
            self.tokens_total += tokens
            self.metrics.step(
                tokens=tokens,
                positions=positions,
                padding=positions - tokens,
                loss=loss if verdict is Verdict.OK else None,
                step_time=step_s,
                data_time=data_s,
            )
            if verdict is Verdict.ROLLBACK:
                raise RuntimeError(
                    f"loss guard: {t.max_bad_steps} bad steps in a row at step {self.step}"
                )
            if is_logged(self.step, first, t):
                p = self.metrics.emit(
                    step=self.step,
                    grad_norm=grad_norm,
                    lr=lr,
                    peak_memory_bytes=peak_memory_bytes(self.device),
                    tokens_total=self.tokens_total,
                    goodput=self.goodput.fraction(),
                    image_token_share=self.image_share,
                )
                self.log(self.metrics.human_line(p) + f" | image tokens {p.image_token_share:.0%}")
            every = self.cfg.checkpoint.every_steps
            if every and self.step % every == 0 and self.step < t.steps:
                self.save()
        if self.step > first:
            self.log(f"saved {self.save()}")
        return Outcome.DONE


def train_vlm(
    cfg: TrainerConfig,
    run_dir: Path,
    env: DistEnv,
    dataset: str,
    vocab_size: int,
    log,
    client=None,
    stop=None,
) -> Outcome:
    """Train the configured stage, then (rank 0) evaluate it on the held-out images."""
    trainer = VlmTrainer(cfg, run_dir, env, dataset, vocab_size, log=log)
    if client is not None:
        trainer.metrics.sinks.append(client.send)
    if stop is not None:
        trainer.stop_requested = stop
    trainer.resume_or_init()
    outcome = trainer.run()
    if outcome is Outcome.DONE and env.is_main:
        report = evaluate.evaluate(trainer.raw, dataset, env.device)
        log(evaluate.describe(report))
        write_json_atomic(str(run_dir / evaluate.REPORT), report)
    return outcome
