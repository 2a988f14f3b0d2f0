"""GENERATE: a checkpoint continues generate.prompt (with generate.image: a VLM answers about
the image), printed with its speed."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from trainer.jobs.context import JobContext, dataset_of, load_checkpoint_model


def run(ctx: JobContext) -> ExitCode:
    from trainer.data.tokenizer import load_tokenizer
    from trainer.generate import generate

    g = ctx.cfg.generate
    if g.image:
        model, dataset, seen = _vlm_and_image(ctx)
    else:
        model, meta, path = load_checkpoint_model(ctx)
        dataset, seen = dataset_of(ctx, meta, path), SeenImage()
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
        image=seen.image,
        embed_images=seen.embed_images,
        image_tokens=seen.image_tokens,
    )
    if ctx.env.is_main:
        print(g.prompt + tokenizer.decode(new), flush=True)
    speed = f"at {tokens_per_s:,.1f} tokens/s"
    if g.image:
        ctx.log(f"generated {len(new)} tokens about {g.image} {speed}")
    else:
        ctx.log(f"generated {len(new)} tokens {speed} on {ctx.env.device.type}")
    return ExitCode.OK


@dataclass(frozen=True)
class SeenImage:
    """What a VLM reads before the prompt (generate.image); empty for a language model."""

    image: torch.Tensor | None = None  # (S, S, 3) uint8
    embed_images: Callable[[torch.Tensor], torch.Tensor] | None = None
    image_tokens: int = 0


def _vlm_and_image(ctx: JobContext) -> tuple[torch.nn.Module, str, SeenImage]:
    """A VLM's language model, its dataset, and the image it answers about."""
    from trainer.data.images import load_image
    from trainer.vlm.checkpoints import load_vlm

    vlm, dataset = load_vlm(ctx)
    g = ctx.cfg.generate
    try:
        image = load_image(g.image, ctx.cfg.vision.image_size)
    except Exception as e:  # PIL raises many kinds
        raise ConfigError("trainer.generate.image", f"{g.image}: not a readable image ({e})") from e
    return (
        vlm.lm,
        dataset,
        SeenImage(torch.from_numpy(image.copy()), vlm.embed_images, vlm.image_tokens),
    )
