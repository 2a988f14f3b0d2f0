"""A run's Progress records as per-step arrays: what the report plots and judges.

A restarted run logs some steps twice (it resumes from its last checkpoint); the last record of
each step is the one that counts (protos/progress_log.py: last_per_step), and the repeats are
counted as recomputed work.
"""

from dataclasses import dataclass

import numpy as np

from protos import progress_pb2
from protos.progress_log import is_eval, is_training_step, last_per_step

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


def run_series(records: list[progress_pb2.Progress]) -> RunSeries:
    trained = last_per_step(records, is_training_step)
    evals = last_per_step(records, is_eval)
    restarts, recomputed = [], 0
    attempt, furthest = None, -1
    for record in filter(is_training_step, records):
        if attempt is not None and record.attempt != attempt:
            restarts.append(record.step)
        attempt = record.attempt
        if record.step <= furthest:
            recomputed += 1
        furthest = max(furthest, record.step)
    return RunSeries(
        steps=np.array(list(trained), dtype=np.int64),
        values={
            field: np.array([getattr(r, field) for r in trained.values()], dtype=np.float64)
            for field in STEP_FIELDS
        },
        eval_steps=np.array(list(evals), dtype=np.int64),
        eval_loss=np.array([r.eval_loss for r in evals.values()], dtype=np.float64),
        restart_steps=restarts,
        recomputed_steps=recomputed,
        events=[(r.step, r.attempt, r.message) for r in records if r.message],
    )
