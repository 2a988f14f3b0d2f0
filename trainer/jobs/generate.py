"""GENERATE: a checkpoint continues generate.prompt (with generate.image: a VLM answers about
the image), printed with its speed."""

import torch

from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from trainer.jobs.context import JobContext, dataset_of, load_checkpoint_model


def run(ctx: JobContext) -> ExitCode:
    if ctx.cfg.generate.image:
        return _about_image(ctx)
    from trainer.data.tokenizer import load_tokenizer
    from trainer.generate import generate

    model, meta, path = load_checkpoint_model(ctx)
    tokenizer = load_tokenizer(dataset_of(ctx, meta, path))
    g = ctx.cfg.generate
    prompt = [tokenizer.bos_id] + tokenizer.encode(g.prompt)  # documents start with BOS
    new, tokens_per_s = generate(
        model,
        prompt,
        g.max_new_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        seed=g.seed,
        stop_id=tokenizer.eos_id,
        max_len=meta.model.max_seq_len,
        vocab=tokenizer.vocab_size,  # a padded embedding's extra rows are never sampled
    )
    if ctx.env.is_main:
        print(g.prompt + tokenizer.decode(new), flush=True)
    ctx.log(f"generated {len(new)} tokens at {tokens_per_s:,.1f} tokens/s on {ctx.env.device.type}")
    return ExitCode.OK


def _about_image(ctx: JobContext) -> ExitCode:
    """Answer generate.prompt about generate.image (sampling as text generate does)."""
    from trainer.data.images import load_image
    from trainer.data.tokenizer import load_tokenizer
    from trainer.vlm.checkpoints import load_vlm
    from trainer.vlm.generate import generate

    model, dataset = load_vlm(ctx)
    g = ctx.cfg.generate
    try:
        image = load_image(g.image, ctx.cfg.vision.image_size)
    except Exception as e:  # PIL raises many kinds
        raise ConfigError("trainer.generate.image", f"{g.image}: not a readable image ({e})") from e
    tok = load_tokenizer(dataset)
    prompt = [tok.bos_id] + tok.encode(g.prompt)
    new, tokens_per_s = generate(model, torch.from_numpy(image.copy()), prompt, g, tok.eos_id)
    if ctx.env.is_main:
        print(g.prompt + tok.decode(new), flush=True)
    ctx.log(f"generated {len(new)} tokens about {g.image} at {tokens_per_s:,.1f} tokens/s")
    return ExitCode.OK
