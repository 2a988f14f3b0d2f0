"""Every training kind (trainer/recipes/): its recipe on the one training core, then its final
evaluation and the loss curves."""

from protos.exit_codes import ExitCode
from trainer.jobs.context import JobContext


def run(ctx: JobContext) -> ExitCode:
    from trainer import loop, plots
    from trainer.recipes import recipe_class

    ctx.install_stop()
    recipe = recipe_class(ctx.kind).for_job(ctx)
    trainer = loop.Trainer(recipe, ctx.run_dir, log=ctx.log)
    trainer.metrics.identity.update(job_id=ctx.attempt.job_id, attempt=ctx.attempt.number)
    if ctx.client is not None:
        trainer.metrics.sinks.append(ctx.client.send)
    trainer.stop_requested = ctx.stop
    trainer.resume_or_init()
    outcome = trainer.run()
    summary = trainer.goodput.summary()
    ctx.log(summary)
    if outcome is loop.Outcome.DONE:
        recipe.finish(trainer.bare, ctx.run_dir, trainer.step)
    if ctx.env.is_main:
        trainer.metrics.write(trainer._progress(phase=outcome.value, message=summary))
        png = plots.plot_loss(ctx.run_dir)
        if png:
            ctx.log(f"loss curves: {png}")
    return ExitCode.PREEMPTED if outcome is loop.Outcome.PREEMPTED else ExitCode.OK
