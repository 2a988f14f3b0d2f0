"""GENERATE: a checkpoint continues generate.prompt (with generate.image: a VLM answers about
the image), printed with its speed."""

from typing import TYPE_CHECKING

import torch

from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from trainer.jobs.context import JobContext, dataset_of, load_checkpoint_model

if TYPE_CHECKING:
    from trainer.vlm.model import VisionLanguageModel


def run(ctx: JobContext) -> ExitCode:
    from trainer.data.tokenizer import load_tokenizer
    from trainer.generate import generate

    g = ctx.cfg.generate
    vlm, image = None, None
    if g.image:
        vlm, dataset, image = _vlm_and_image(ctx)
        model = vlm.lm
    else:
        model, meta, path = load_checkpoint_model(ctx)
        dataset = dataset_of(ctx, meta, path)
    tokenizer = load_tokenizer(dataset)
    new, tokens_per_s = generate(
        model,
        [tokenizer.bos_id] + tokenizer.encode(g.prompt),  # documents start with BOS
        g.max_new_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        seed=g.seed,
        stop_id=tokenizer.eos_id,
        max_len=model.rope.cos.shape[0],  # a VLM's: image tokens + data.seq_len
        vocab=tokenizer.vocab_size,  # a padded embedding's extra rows are never sampled
        image=image,
        embed_images=vlm.embed_images if vlm else None,
        image_tokens=vlm.image_tokens if vlm else 0,
    )
    if ctx.env.is_main:
        print(g.prompt + tokenizer.decode(new), flush=True)
    speed = f"at {tokens_per_s:,.1f} tokens/s"
    if g.image:
        ctx.log(f"generated {len(new)} tokens about {g.image} {speed}")
    else:
        ctx.log(f"generated {len(new)} tokens {speed} on {ctx.env.device.type}")
    return ExitCode.OK


def _vlm_and_image(ctx: JobContext) -> tuple["VisionLanguageModel", str, torch.Tensor]:
    """The VLM, its dataset, and the image it answers about ((S, S, 3) uint8)."""
    from trainer.data.images import load_image
    from trainer.vlm.checkpoints import load_vlm

    vlm, dataset = load_vlm(ctx)
    g = ctx.cfg.generate
    try:
        image = load_image(g.image, ctx.cfg.vision.image_size)
    except Exception as e:  # PIL raises many kinds
        raise ConfigError("trainer.generate.image", f"{g.image}: not a readable image ({e})") from e
    return vlm, dataset, torch.from_numpy(image.copy())
