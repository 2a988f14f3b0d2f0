"""What every job of the trainer is handed, built once by trainer/main.py: the resolved config,
the launcher's Attempt, the process group, the log, the launcher's progress client and the
stop check; and what several kinds of job share (the precooked data, a checkpoint's model)."""

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from protos import attempt_pb2, job_pb2, paths, provenance, trainer_config_pb2

if TYPE_CHECKING:
    from trainer.distributed import DistEnv
    from trainer.progress_client import ProgressClient


class BadInput(Exception):
    """A config or input problem: exit 2 with this message."""


def make_log(run_dir: Path, is_main: bool) -> Callable[[str], None]:
    """print() to stdout and train.log on rank 0; other ranks stay quiet."""
    log_file = open(run_dir / "train.log", "a") if is_main else None  # noqa: SIM115

    def log(message: str) -> None:
        if log_file is None:
            return
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    return log


def install_sigterm_handler() -> Callable[[], bool]:
    """SIGTERM (a preemption) sets a flag the job checks between steps; returns the check."""
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    return lambda: bool(received)


@dataclasses.dataclass
class JobContext:
    cfg: trainer_config_pb2.TrainerConfig  # resolved (protos.validation)
    attempt: attempt_pb2.Attempt
    env: "DistEnv"
    log: Callable[[str], None]
    client: "ProgressClient | None"  # rank 0 of a launched job: reports progress
    # SIGTERM or the launcher's stop: a job that sees it saves what it has and exits 75.
    stop: Callable[[], bool] = lambda: False

    @property
    def kind(self) -> job_pb2.JobKind:
        return self.attempt.spec.kind

    @property
    def run_dir(self) -> Path:
        return Path(self.attempt.run_dir)

    def install_stop(self) -> None:
        sigterm = install_sigterm_handler()
        launcher = self.client.stop_requested.is_set if self.client else (lambda: False)
        self.stop = lambda: sigterm() or launcher()

    def send(self, record) -> None:
        """A progress record to the launcher (rank 0 of a launched job; else nothing)."""
        if self.client is not None:
            self.client.send(record)


def precook(ctx: JobContext):
    """The precooked dataset of `cfg.data` in the attempt's cache, built by rank 0 while the
    others wait: text, or images and text (trainer/data/images.py) for an image format."""
    from protos.validation_kinds import IMAGE_FORMATS
    from trainer import distributed

    cfg, cache, env, log = ctx.cfg, ctx.attempt.cache_dir, ctx.env, ctx.log
    images = cfg.data.format in IMAGE_FORMATS
    if env.is_main:
        try:
            os.makedirs(cache, exist_ok=True)
        except OSError as e:
            raise BadInput(
                f"trainer.data.cache_dir: cannot create the precook cache {cache}: {e.strerror} "
                f"(set data.cache_dir, or {paths.STATE_DIR_ENV} for the state dir)"
            ) from e
        source = cfg.data.input or "the Python standard library"
        log(f"precook: {source}{' (images)' if images else ''} -> cache {cache}")
    if env.is_main:
        ds = _precook_once(cfg, cache, images, show_progress=True)
    distributed.barrier()
    if not env.is_main:
        ds = _precook_once(cfg, cache, images, show_progress=False)
    if images:
        m = ds.manifest
        log(
            f"dataset {ds.path} ({'cache hit' if ds.cache_hit else 'built'}): "
            + ", ".join(
                f"{k} {s.records:,} records on {s.images:,} images" for k, s in m.splits.items()
            )
            + (f"; {len(m.skipped_images)} unreadable images skipped" if m.skipped_images else "")
        )
    else:
        log(f"dataset {ds.path} ({'cache hit' if ds.cache_hit else 'built'})")
    if env.is_main:  # its digest: the MLflow run's tags, `kitchen diff`
        provenance.record_dataset(str(ctx.run_dir), ds.path)
    return ds


def _precook_once(cfg, cache: str, images: bool, show_progress: bool):
    if images:
        from trainer.data.images import precook_images

        return precook_images(cfg, cache, show_progress=show_progress)
    from trainer.data.precook import precook_dataset

    return precook_dataset(cfg.data, cache, show_progress=show_progress)


def vocab_size_of(ds) -> int:
    """A precooked dataset's vocabulary: text datasets carry their tokenizer."""
    tokenizer = getattr(ds, "tokenizer", None)
    return tokenizer.vocab_size if tokenizer is not None else ds.manifest.vocab_size


def checkpoint_path(ctx: JobContext, path: Path | None = None) -> Path:
    """`path`, checkpoint.path, or the newest valid checkpoint of the run."""
    from trainer import checkpoint

    if path is None and ctx.cfg.checkpoint.path:
        path = Path(ctx.cfg.checkpoint.path)
    if path is None:
        found = checkpoint.newest_valid(
            ctx.run_dir / "checkpoints", files=("model.pt",), warn=ctx.log
        )
        if found is None:
            raise BadInput(f"trainer.checkpoint.path: empty and no checkpoint in {ctx.run_dir}")
        path = found[0]
    return path


def load_checkpoint_model(ctx: JobContext, path: Path | None = None):
    """(model, meta, checkpoint dir) from `path`, checkpoint.path or the newest valid one of
    the run: its language model (trainer/checkpoint.py `load_model`)."""
    from trainer import checkpoint

    path = checkpoint_path(ctx, path)
    try:
        model, meta = checkpoint.load_model(path, ctx.env.device, ctx.cfg.model.use_kernels)
    except checkpoint.CheckpointError as e:
        raise BadInput(f"trainer.checkpoint.path: {e}") from e
    ctx.log(f"loaded {path} (step {meta.step})")
    return model, meta, path


def dataset_of(ctx: JobContext, meta, path: Path) -> str:
    """Checkpoint `path`'s own dataset when it is still there, else `cfg.data` precooked (an
    imported checkpoint has none: its job names the data, with the model's tokenizer, which
    trainer/interop/vocab.py checks)."""
    if meta.dataset and Path(meta.dataset).exists():
        return meta.dataset
    from trainer.interop import vocab

    ds = precook(ctx)
    problem = vocab.dataset_problem(path, meta, ds.path)
    if problem:
        raise BadInput(
            f"trainer.data.tokenizer: {problem}: precook with the checkpoint's tokenizer "
            "(BPE_FILE, tokenizer_path)"
        )
    return ds.path
