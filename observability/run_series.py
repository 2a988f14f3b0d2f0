"""A run's Progress records as per-step arrays: what the report plots and judges.

A restarted run logs some steps twice (it resumes from its last checkpoint); the last record of
each step is the one that counts, and the repeats are counted as recomputed work.
"""

from dataclasses import dataclass

import numpy as np

# The Progress fields that vary per training step.
STEP_FIELDS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_second",
    "step_time_seconds",
    "data_time_seconds",
    "mfu",
    "tflops",
    "peak_memory_bytes",
    "padding_fraction",
    "goodput",
)


@dataclass
class RunSeries:
    steps: np.ndarray  # sorted, unique
    values: dict[str, np.ndarray]  # Progress field name -> value at each step
    eval_steps: np.ndarray
    eval_loss: np.ndarray
    restart_steps: list[int]  # first step logged by each new attempt
    recomputed_steps: int  # steps logged again after a restart
    events: list[tuple[int, int, str]]  # (step, attempt, message)


def _is_training_step(record) -> bool:
    # Event lines ("checkpoint saved") repeat a step number but carry no step time.
    return record.phase in ("train", "") and record.step_time_seconds > 0


def run_series(records: list) -> RunSeries:
    by_step, restarts, recomputed, events = {}, [], 0, []
    evals = {}
    attempt, furthest = None, -1
    for record in records:
        if record.message:
            events.append((record.step, record.attempt, record.message))
        if record.eval_loss and (record.phase == "eval" or not _is_training_step(record)):
            evals[record.step] = record.eval_loss
        if not _is_training_step(record):
            continue
        if attempt is not None and record.attempt != attempt:
            restarts.append(record.step)
        attempt = record.attempt
        if record.step <= furthest:
            recomputed += 1
        furthest = max(furthest, record.step)
        by_step[record.step] = record
    steps = np.array(sorted(by_step), dtype=np.int64)
    values = {
        field: np.array([getattr(by_step[s], field) for s in steps], dtype=np.float64)
        for field in STEP_FIELDS
    }
    eval_steps = np.array(sorted(evals), dtype=np.int64)
    return RunSeries(
        steps=steps,
        values=values,
        eval_steps=eval_steps,
        eval_loss=np.array([evals[s] for s in eval_steps], dtype=np.float64),
        restart_steps=restarts,
        recomputed_steps=recomputed,
        events=events,
    )
