"""SERVE: a checkpoint behind an OpenAI-compatible API until stopped (trainer/serve/). On image
data, a VLM checkpoint: its language model in the engine, its encoder and projector for the
images of chat requests. With serve.draft_path, speculative decoding's draft model."""

from pathlib import Path

from protos.exit_codes import ExitCode
from protos.validation_kinds import IMAGE_FORMATS
from trainer.jobs.context import BadInput, JobContext, dataset_of, load_checkpoint_model

DRAFT_FIELD = "trainer.serve.draft_path"


def load_draft(ctx: JobContext, target_path: Path | None, target_meta, max_len: int):
    """serve.draft_path's model (None: no draft model), refused naming the field unless it
    reads the served model's tokens: as many ids, the same tokenizer file where both are known
    (trainer/interop/vocab.py), and at least its positions."""
    if not ctx.cfg.serve.draft_path:
        return None
    from trainer import checkpoint
    from trainer.interop.vocab import own_tokenizer_sha256

    path = Path(ctx.cfg.serve.draft_path)
    try:
        draft, meta = checkpoint.load_model(path, ctx.env.device, ctx.cfg.model.use_kernels)
    except checkpoint.CheckpointError as e:
        raise BadInput(f"{DRAFT_FIELD}: {e}") from e
    if meta.vocab_size != target_meta.vocab_size:
        raise BadInput(
            f"{DRAFT_FIELD}: {path} has a {meta.vocab_size}-token vocabulary, the served model "
            f"{target_meta.vocab_size}: a draft must share the served model's tokenizer"
        )
    if target_path is not None:
        ours = own_tokenizer_sha256(target_path, target_meta.dataset)
        theirs = own_tokenizer_sha256(path, meta.dataset)
        if ours and theirs and ours != theirs:
            raise BadInput(
                f"{DRAFT_FIELD}: {path} was made with another tokenizer (sha256 {theirs[:12]}, "
                f"the served model's {ours[:12]}): a draft must share the served model's"
            )
    if meta.model.max_seq_len < max_len:
        raise BadInput(
            f"{DRAFT_FIELD}: {path} reads {meta.model.max_seq_len} positions, the served model "
            f"{max_len}: the draft must read every position"
        )
    params = sum(p.numel() for p in draft.parameters())
    ctx.log(f"draft model {path} (step {meta.step}, {params / 1e6:.2f} M parameters)")
    return draft


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
        if cfg.serve.draft_path:
            raise BadInput(f"{DRAFT_FIELD}: a VLM's language model takes no draft model yet")
        return serve(vlm.lm, tok, max_len, cfg.serve, ctx.attempt, ctx.log, ctx.client, images)
    model, meta, path = load_checkpoint_model(ctx)
    tokenizer = load_tokenizer(dataset_of(ctx, meta, path))
    max_len = meta.model.max_seq_len
    draft = load_draft(ctx, path, meta, max_len)
    return serve(
        model, tokenizer, max_len, cfg.serve, ctx.attempt, ctx.log, ctx.client, draft=draft
    )
