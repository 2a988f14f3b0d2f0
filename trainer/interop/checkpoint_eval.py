"""One checkpoint's scores for an EVAL job: Kitchen's held-out loss and continuation choice
(trainer/evaluate.py) plus the lm-evaluation-harness tasks of `trainer.eval.tasks`, as the
eval.json report and as one Progress record (phase "eval", step = the checkpoint's step, a
score per task and metric) for metrics.jsonl, the launcher and Prometheus."""

import math
from pathlib import Path
from typing import Any

from protos import progress_pb2
from protos.config_yaml import ConfigError
from protos.trainer_config_pb2 import TrainerConfig
from trainer import evaluate
from trainer.interop.harness import TaskScore

HELDOUT = "heldout"  # the task name of Kitchen's own scores in eval_scores


def evaluate_checkpoint(
    model, meta, path: Path, dataset: str, cfg: TrainerConfig, env, dtype, log
) -> tuple[dict[str, Any], list[TaskScore]]:
    """(eval.json report, every score) of checkpoint `path` (loaded as `model`, `meta`)."""
    result = evaluate.heldout_loss(model, dataset, cfg, env, dtype)
    if result is None:
        raise ConfigError("trainer.data.eval_fraction", f"{dataset}: the eval split is empty")
    accuracy, asked = evaluate.choice_accuracy(model, dataset, cfg, env, dtype)
    log(
        f"eval {path.name}: loss {result.loss:.4f} nats/token, perplexity {result.perplexity:,.2f}"
        f" over {result.tokens:,} held-out tokens; continuation choice accuracy "
        f"{accuracy:.1%} on {asked} questions (chance {1 / evaluate.CHOICES:.0%})"
    )
    report: dict[str, Any] = dict(result._asdict(), checkpoint=str(path), step=meta.step)
    report.update(choice_accuracy=accuracy, choice_questions=asked)
    scores = [
        TaskScore(HELDOUT, "loss", result.loss, math.nan),
        TaskScore(HELDOUT, "perplexity", result.perplexity, math.nan),
    ]
    if asked:
        stderr = math.sqrt(accuracy * (1 - accuracy) / asked)
        scores.append(TaskScore(HELDOUT, "choice_accuracy", accuracy, stderr))
    if cfg.eval.tasks:
        harness = harness_scores(model, meta, dataset, cfg)
        for s in harness:
            spread = "" if math.isnan(s.stderr) else f" ± {s.stderr:.4f}"
            log(f"  {s.task} {s.metric}: {s.value:.4f}{spread}")
        report["harness"] = {f"{s.task}/{s.metric}": s.value for s in harness}
        scores += harness
    return report, scores


def harness_scores(model, meta, dataset: str, cfg: TrainerConfig) -> list[TaskScore]:
    from trainer.data.tokenizer import load_tokenizer
    from trainer.interop.harness import run_tasks
    from trainer.interop.lm_eval_adapter import KitchenLM

    lm = KitchenLM(model, load_tokenizer(dataset), meta.model.max_seq_len, cfg.eval.batch_size)
    return run_tasks(lm, cfg.eval)


def progress(step: int, path: Path, scores: list[TaskScore], **ids) -> progress_pb2.Progress:
    """The record of one evaluated checkpoint (`ids`: job_id, attempt)."""
    loss = next(s.value for s in scores if (s.task, s.metric) == (HELDOUT, "loss"))
    return progress_pb2.Progress(
        phase="eval",
        step=step,
        eval_loss=loss,
        message=f"evaluated {path}",
        eval_scores=[
            progress_pb2.EvalScore(task=s.task, metric=s.metric, value=s.value) for s in scores
        ],
        **ids,
    )
