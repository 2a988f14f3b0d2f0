"""PRECOOK: raw text (or images and text) into packed token rows in the shared cache; with
`data.tasks` > 1, as that many local processes (#21, trainer/data/tasks.py)."""

from protos.exit_codes import ExitCode
from trainer.jobs.context import JobContext, precook


def run(ctx: JobContext) -> ExitCode:
    from protos.validation_kinds import IMAGE_FORMATS

    cfg = ctx.cfg
    if cfg.data.tasks > 1 and cfg.data.format not in IMAGE_FORMATS:
        from trainer.data import task_steps

        ctx.log(task_steps.summary(task_steps.precook_as_tasks(cfg.data, ctx.attempt.cache_dir)))
        return ExitCode.OK
    ds = precook(ctx)
    if cfg.data.format in IMAGE_FORMATS:
        return ExitCode.OK
    counts = ds.manifest.counts
    ctx.log(
        f"precooked {counts.documents:,} documents, {counts.tokens:,} tokens "
        f"in {counts.rows:,} rows ({counts.padding_tokens:,} padding tokens)"
    )
    return ExitCode.OK
