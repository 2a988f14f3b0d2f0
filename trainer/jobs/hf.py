"""EXPORT and IMPORT (#19, trainer/interop/): a checkpoint out as a Hugging Face model
directory, and a Hugging Face Llama directory in as checkpoint step 0 of the job's run."""

from pathlib import Path

from google.protobuf import json_format

from protos.exit_codes import ExitCode
from trainer.jobs.context import BadInput, JobContext, dataset_of, load_checkpoint_model


def export(ctx: JobContext) -> ExitCode:
    """A checkpoint as a Hugging Face model directory: trainer.hf.path, else <run dir>/hf."""
    import torch

    from protos.defaults import DTYPES
    from trainer.data.tokenizer import load_tokenizer
    from trainer.interop.hf_export import export_checkpoint

    _, meta, path = load_checkpoint_model(ctx)
    tokenizer = load_tokenizer(dataset_of(ctx, meta, path))
    name = DTYPES[ctx.cfg.hf.dtype.lower()]  # validated; None: as the checkpoint holds them
    dtype = getattr(torch, name) if name else None
    if ctx.env.is_main:
        out = Path(ctx.cfg.hf.path or ctx.run_dir / "hf")
        try:
            done = export_checkpoint(path, tokenizer, out, dtype)
        except FileExistsError as e:
            raise BadInput(f"trainer.hf.path: {e}") from e
        size = sum(d.bytes for d in done.files.values())
        ctx.log(
            f"exported {path.name} ({done.parameters:,} parameters) -> {done.path} ({size:,} bytes)"
        )
    return ExitCode.OK


def import_(ctx: JobContext) -> ExitCode:
    """A Hugging Face Llama directory (trainer.hf.path) as checkpoint step 0 of this run."""
    from trainer.interop.hf_import import import_hf

    if not ctx.env.is_main:
        return ExitCode.OK
    hf_path = ctx.cfg.hf.path
    path, meta = import_hf(Path(hf_path), ctx.run_dir / "checkpoints")
    model = json_format.MessageToDict(meta.model, preserving_proto_field_name=True)
    ctx.log(f"imported {hf_path} -> {path} (vocabulary {meta.vocab_size:,})")
    ctx.log(f"to fine-tune it: checkpoint.path {path}, trainer.model {model}")
    return ExitCode.OK
