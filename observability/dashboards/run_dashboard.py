"""The run dashboard: is this training job healthy? One job or several, picked with $job_id.

The panels of catalog metrics come from protos/metric_catalog.py (catalog_panels.py); the ones
here are derived: recording rules, ratios, and the launcher's own series."""

from grafana_foundation_sdk.builders import stat
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards.catalog_panels import LEGEND, add_rows, selector, series
from observability.dashboards.panels import (
    kitchen_dashboard,
    multi_value_variable,
    stat_panel,
    target,
    timeseries_panel,
)
from protos import metric_panels
from protos.metric_catalog import metric
from protos.metric_panels import Board

UID = Board.RUN.value
LOSS = series("loss")
MFU = selector("job_id:kitchen_train_mfu_ratio:avg1m")
TOKENS = selector("job_id:kitchen_train_tokens:rate1m")
P50 = selector("job_id:kitchen_train_step_duration_seconds:p50_1m")
P99 = selector("job_id:kitchen_train_step_duration_seconds:p99_1m")
GOODPUT = series("goodput")
MEMORY = series("peak_memory_bytes")
RESTARTS = selector("kitchen_job_attempts_total") + " - 1"
PROGRESS = series("step") + " / " + series("total_steps")


def _glance(title: str, description: str, unit: str, expr: str) -> stat.Panel:
    return stat_panel(title, description, unit, expr, LEGEND, width=3)


def _at_a_glance() -> list:
    return [
        _glance(
            "Progress", "Latest step over the steps the job will run.", "percentunit", PROGRESS
        ),
        _glance("Loss", "Training loss at the latest report.", "none", LOSS),
        _glance("MFU", "Model FLOPs utilization, 1-minute mean.", "percentunit", MFU),
        _glance("Tokens/s", "Training tokens per second, 1-minute rate.", "short", TOKENS),
        _glance("Step time p50", "Median step time over the last minute.", "s", P50),
        _glance("Goodput", "Share of wall time spent on steps that count.", "percentunit", GOODPUT),
        _glance("Peak memory", "Peak accelerator memory.", "bytes", MEMORY),
        _glance("Restarts", "Attempts after the first, preemptions included.", "none", RESTARTS),
    ]


def _training() -> list:
    return [
        timeseries_panel(
            "MFU",
            "Model FLOPs utilization: achieved training FLOP/s over the accelerator's peak. "
            "Healthy: flat after warm-up (30-50% for large dense models on H100). A sag "
            "means a slow node, throttling or input stalls.",
            "percentunit",
            [target(MFU, LEGEND)],
            min_value=0,
        ),
        timeseries_panel(
            "Throughput",
            "Training tokens per second, from the token counter (restarts do not reset it).",
            "short",
            [target(TOKENS, LEGEND)],
            axis_label="tokens/s",
            min_value=0,
        ),
        timeseries_panel(
            "Step time p50 / p99",
            "Step time quantiles over the last minute. p99 far above p50 every few minutes "
            "is checkpointing (a sawtooth); p50 rising is a straggler or a slow input.",
            "s",
            [target(P50, "p50 " + LEGEND, "A"), target(P99, "p99 " + LEGEND, "B")],
            min_value=0,
        ),
        timeseries_panel(
            "Restarts and preemptions",
            "Attempts after the first (crashes, hangs, node loss and preemptions; each "
            "resumes from the last checkpoint) and, of those, preemptions, which are not "
            "failures.",
            "none",
            [
                target(RESTARTS, "restarts " + LEGEND, "A"),
                target(selector("kitchen_job_preemptions_total"), "preemptions " + LEGEND, "B"),
            ],
            min_value=0,
        ),
        timeseries_panel(
            "Eval scores",
            "Scores of eval jobs (held-out loss, lm-evaluation-harness tasks), one series "
            "per task, metric and checkpoint step: a sweep over a run's checkpoints draws "
            "one line per step. Did the model get better? Later steps score higher "
            "(accuracy) or lower (loss, perplexity). Guide: docs/eval.md",
            "none",
            [target(selector("kitchen_eval_score"), "{{task}} {{metric}} step {{step}}")],
        ),
    ]


def build() -> Dashboard:
    board = kitchen_dashboard(
        UID,
        "Kitchen run",
        "One training run: loss, MFU, throughput, step time, goodput, memory, restarts, "
        "experts. "
        "Guide: docs/observability.md",
    ).with_variable(
        multi_value_variable("job_id", "Job", f"label_values({metric('step').name}, job_id)")
    )
    derived = {metric_panels.RUN_GLANCE: _at_a_glance(), metric_panels.RUN_TRAINING: _training()}
    return add_rows(board, Board.RUN, derived).build()
