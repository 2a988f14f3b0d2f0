"""A VLM checkpoint for the jobs that read one (eval, generate, serve on image data): the
whole model rebuilt from the job's trainer.vision section, and the dataset it was trained on."""

import torch

from protos.config_yaml import ConfigError
from trainer.jobs.context import JobContext, checkpoint_path, precook


def load_vlm(ctx: JobContext):
    """(model in eval mode, dataset path): the VLM checkpoint of checkpoint.path (or the run's
    newest); the dataset is the checkpoint's when it is still there, else cfg.data precooked."""
    from pathlib import Path

    from trainer import checkpoint
    from trainer.model_setup import seed_everything
    from trainer.vlm.recipe import build_vlm

    found = checkpoint_path(ctx)
    try:
        meta = checkpoint.verify(found, files=("model.pt",))
    except checkpoint.CheckpointError as e:
        raise ConfigError("trainer.checkpoint.path", str(e)) from e
    if meta.kind != "VLM":
        raise ConfigError(
            "trainer.checkpoint.path", f"{found} is a {meta.kind} checkpoint, not a VLM"
        )
    seed_everything(ctx.cfg.train.seed)
    model = build_vlm(ctx.cfg, meta.vocab_size, ctx.env.device)
    try:
        state = torch.load(found / "model.pt", map_location="cpu", weights_only=True)
        checkpoint.load_model_state(model, state)
    except RuntimeError as e:
        raise ConfigError("trainer.vision", f"does not match the checkpoint {found}: {e}") from e
    ctx.log(f"loaded {found} (VLM, step {meta.step})")
    dataset = meta.dataset if Path(meta.dataset).exists() else precook(ctx).path
    return model.eval(), dataset
