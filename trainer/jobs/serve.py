"""SERVE: a checkpoint behind an OpenAI-compatible API until stopped (trainer/serve/). On image
data, a VLM checkpoint: its language model in the engine, its encoder and projector for the
images of chat requests."""

from protos.exit_codes import ExitCode
from protos.validation_kinds import IMAGE_FORMATS
from trainer.jobs.context import JobContext, dataset_of, load_checkpoint_model


def run(ctx: JobContext) -> ExitCode:
    from trainer.data.tokenizer import load_tokenizer
    from trainer.serve.server import serve

    cfg = ctx.cfg
    if cfg.data.format in IMAGE_FORMATS:
        from trainer.serve.images import PromptImages
        from trainer.vlm.checkpoints import load_vlm

        vlm, dataset = load_vlm(ctx)
        tok = load_tokenizer(dataset)
        images = PromptImages(cfg.vision.image_size, vlm.image_tokens, vlm.embed_images)
        max_len = vlm.lm.rope.cos.shape[0]  # image tokens + data.seq_len, or model.max_seq_len
        return serve(vlm.lm, tok, max_len, cfg.serve, ctx.attempt, ctx.log, ctx.client, images)
    model, meta, path = load_checkpoint_model(ctx)
    tokenizer = load_tokenizer(dataset_of(ctx, meta, path))
    max_len = meta.model.max_seq_len
    return serve(model, tokenizer, max_len, cfg.serve, ctx.attempt, ctx.log, ctx.client)
