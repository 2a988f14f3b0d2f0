"""The trainer's VLM jobs (trainer/main.py dispatches here): a stage (kind VLM), the eval of a
VLM checkpoint (kind EVAL on image data), generate with an image (generate.image), and the
serve job of a VLM checkpoint (kind SERVE on image data: chat requests may hold an image)."""

import os
from pathlib import Path

import torch

from protos import attempt_pb2, job_pb2
from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from protos.files import write_json_atomic
from protos.trainer_config_pb2 import TrainerConfig
from protos.validation_kinds import IMAGE_FORMATS
from trainer.data.images import load_image, precook_images
from trainer.loop import Outcome


def handles(kind: int, cfg: TrainerConfig) -> bool:
    """Whether trainer/main.py hands this job here: kind VLM, or any job on image data, or
    generate with an image."""
    return kind == job_pb2.VLM or cfg.data.format in IMAGE_FORMATS or bool(cfg.generate.image)


def run(cfg: TrainerConfig, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    kind = attempt.spec.kind
    if kind == job_pb2.VLM:
        return train_job(cfg, attempt, env, log, client)
    if kind == job_pb2.PRECOOK:
        precook(cfg, attempt.cache_dir, env, log)
        return ExitCode.OK
    if kind == job_pb2.EVAL:
        return eval_job(cfg, attempt, env, log)
    if kind == job_pb2.GENERATE:
        return generate_job(cfg, attempt, env, log)
    if kind == job_pb2.SERVE:
        return serve_job(cfg, attempt, env, log, client)
    name = job_pb2.JobKind.Name(kind)
    raise ConfigError("trainer.data.format", f"a {name} job does not read images")


def precook(cfg: TrainerConfig, cache: str, env, log):
    """The precooked image+text dataset of `cfg`, built by rank 0 while the others wait."""
    from trainer import distributed

    if env.is_main:
        os.makedirs(cache, exist_ok=True)
        log(f"precook: {cfg.data.input} (images) -> cache {cache}")
        ds = precook_images(cfg, cache, show_progress=True)
    distributed.barrier()
    if not env.is_main:
        ds = precook_images(cfg, cache, show_progress=False)
    m = ds.manifest
    log(
        f"dataset {ds.path} ({'cache hit' if ds.cache_hit else 'built'}): "
        + ", ".join(
            f"{k} {s.records:,} records on {s.images:,} images" for k, s in m.splits.items()
        )
        + (f"; {len(m.skipped_images)} unreadable images skipped" if m.skipped_images else "")
    )
    return ds


def train_job(cfg: TrainerConfig, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    from trainer import loop
    from trainer.vlm.train import train_vlm

    ds = precook(cfg, attempt.cache_dir, env, log)
    sigterm = loop.install_sigterm_handler()
    launcher_stop = client.stop_requested.is_set if client else (lambda: False)
    outcome = train_vlm(
        cfg,
        Path(attempt.run_dir),
        env,
        ds.path,
        ds.manifest.vocab_size,
        log,
        client,
        stop=lambda: sigterm() or launcher_stop(),
    )
    return ExitCode.PREEMPTED if outcome is Outcome.PREEMPTED else ExitCode.OK


def _load(cfg: TrainerConfig, run_dir: Path, env, log):
    """(model, dataset path): the VLM checkpoint of checkpoint.path (or the run's newest)."""
    from trainer import checkpoint
    from trainer.vlm.train import build_vlm

    found = Path(cfg.checkpoint.path) if cfg.checkpoint.path else None
    if found is None:
        newest = checkpoint.newest_valid(run_dir / "checkpoints", files=("model.pt",), warn=log)
        if newest is None:
            raise ConfigError("trainer.checkpoint.path", f"empty and no checkpoint in {run_dir}")
        found = newest[0]
    try:
        meta = checkpoint.verify(found, files=("model.pt",))
    except checkpoint.CheckpointError as e:
        raise ConfigError("trainer.checkpoint.path", str(e)) from e
    if meta.kind != "VLM":
        raise ConfigError(
            "trainer.checkpoint.path", f"{found} is a {meta.kind} checkpoint, not a VLM"
        )
    model = build_vlm(cfg, meta.vocab_size, env.device)
    try:
        checkpoint.load_model_state(model, torch.load(found / "model.pt", map_location="cpu"))
    except RuntimeError as e:
        raise ConfigError("trainer.vision", f"does not match the checkpoint {found}: {e}") from e
    log(f"loaded {found} (VLM, step {meta.step})")
    return model.eval(), meta.dataset


def _dataset(cfg: TrainerConfig, attempt: attempt_pb2.Attempt, dataset: str, env, log) -> str:
    """The checkpoint's dataset when it is still there, else cfg.data precooked again."""
    if Path(dataset).exists():
        return dataset
    return precook(cfg, attempt.cache_dir, env, log).path


def eval_job(cfg: TrainerConfig, attempt: attempt_pb2.Attempt, env, log) -> ExitCode:
    from trainer.vlm import evaluate

    model, dataset = _load(cfg, Path(attempt.run_dir), env, log)
    dataset = _dataset(cfg, attempt, dataset, env, log)
    report = evaluate.evaluate(model, dataset, env.device)
    log(evaluate.describe(report))
    if env.is_main:
        write_json_atomic(str(Path(attempt.run_dir) / evaluate.REPORT), report)
    return ExitCode.OK


def generate_job(cfg: TrainerConfig, attempt: attempt_pb2.Attempt, env, log) -> ExitCode:
    """Answer generate.prompt about generate.image (sampling as text generate does)."""
    from trainer.data.tokenizer import load_tokenizer
    from trainer.vlm.generate import generate

    model, dataset = _load(cfg, Path(attempt.run_dir), env, log)
    try:
        image = load_image(cfg.generate.image, cfg.vision.image_size)
    except Exception as e:  # PIL raises many kinds
        raise ConfigError(
            "trainer.generate.image", f"{cfg.generate.image}: not a readable image ({e})"
        ) from e
    tok = load_tokenizer(dataset)
    g = cfg.generate
    prompt = [tok.bos_id] + tok.encode(g.prompt)
    new, tokens_per_s = generate(model, torch.from_numpy(image.copy()), prompt, g, tok.eos_id)
    if env.is_main:
        print(g.prompt + tok.decode(new), flush=True)
    log(f"generated {len(new)} tokens about {g.image} at {tokens_per_s:,.1f} tokens/s")
    return ExitCode.OK


def serve_job(cfg: TrainerConfig, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    """The VLM checkpoint behind the OpenAI API (trainer/serve/): its language model in the
    engine, its encoder and projector for the images of chat requests."""
    from trainer.data.tokenizer import load_tokenizer
    from trainer.serve.images import PromptImages
    from trainer.serve.server import serve

    model, dataset = _load(cfg, Path(attempt.run_dir), env, log)
    tok = load_tokenizer(_dataset(cfg, attempt, dataset, env, log))
    images = PromptImages(cfg.vision.image_size, model.image_tokens, model.embed_images)
    max_len = model.lm.rope.cos.shape[0]  # image tokens + data.seq_len, or model.max_seq_len
    return serve(model.lm, tok, max_len, cfg.serve, attempt, log, client, images=images)
