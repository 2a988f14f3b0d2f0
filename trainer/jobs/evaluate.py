"""EVAL: held-out loss, continuation choice and the harness tasks of trainer.eval.tasks, of one
checkpoint (eval.json) or of every checkpoint under trainer.eval.sweep (sweep.json and
sweep.png); each checkpoint's scores are a Progress record (trainer/interop/). On image data,
a VLM checkpoint's held-out loss and answer accuracy (trainer/vlm/evaluate.py)."""

from pathlib import Path

from protos.exit_codes import ExitCode
from protos.validation_kinds import IMAGE_FORMATS
from trainer.jobs.context import JobContext, dataset_of, load_checkpoint_model


def run(ctx: JobContext) -> ExitCode:
    if ctx.cfg.data.format in IMAGE_FORMATS:
        return _vlm(ctx)
    from protos.files import write_json_atomic
    from protos.progress_log import append_progress, log_path
    from trainer import checkpoint
    from trainer.config import train_dtype
    from trainer.interop import checkpoint_eval, harness, sweep

    cfg, env, log = ctx.cfg, ctx.env, ctx.log
    dtype = train_dtype(cfg, env.device)
    if cfg.eval.tasks:  # an unknown task name: exit 2 before any checkpoint is evaluated
        harness.task_specs(list(cfg.eval.tasks), cfg.eval.tasks_dir, cfg.eval.allow_task_code)
    targets: list[tuple[str, Path | None]] = [("", None)]
    if cfg.eval.sweep:
        targets = list(sweep.sweep_targets(Path(cfg.eval.sweep)))
    rows: list[dict] = []
    report: dict = {}
    for run_name, target in targets:
        if target is not None:
            try:
                checkpoint.verify(target, files=("model.pt",))
            except checkpoint.CheckpointError as e:
                log(f"WARNING: skipping damaged checkpoint: {e}")
                continue
        model, meta, path = load_checkpoint_model(ctx, target)
        dataset = dataset_of(ctx, meta, path)
        report, scores = checkpoint_eval.evaluate_checkpoint(
            model, meta, path, dataset, cfg, env, dtype, log
        )
        if env.is_main:
            ids = {"job_id": ctx.attempt.job_id, "attempt": ctx.attempt.number}
            record = checkpoint_eval.progress(meta.step, path, scores, **ids)
            append_progress(log_path(ctx.run_dir), record)
            ctx.send(record)
        rows.append(sweep.row(run_name or ctx.run_dir.name, path, meta.step, scores))
    if env.is_main and cfg.eval.sweep:
        log(f"sweep of {len(rows)} checkpoints: {sweep.write_sweep(ctx.run_dir, rows)}")
    elif env.is_main:
        write_json_atomic(str(ctx.run_dir / "eval.json"), report)
    return ExitCode.OK


def _vlm(ctx: JobContext) -> ExitCode:
    from protos.files import write_json_atomic
    from trainer.vlm import evaluate
    from trainer.vlm.checkpoints import load_vlm

    model, dataset = load_vlm(ctx)
    report = evaluate.evaluate(model, dataset, ctx.env.device)
    ctx.log(evaluate.describe(report))
    if ctx.env.is_main:
        write_json_atomic(str(ctx.run_dir / evaluate.REPORT), report)
    return ExitCode.OK
