"""The run dashboard: is this training job healthy? One job or several, picked with $job_id."""

from grafana_foundation_sdk.builders import dashboard, stat
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards.panels import (
    kitchen_dashboard,
    multi_value_variable,
    stat_panel,
    target,
    timeseries_panel,
)

UID = "kitchen-run"
JOB = 'job_id=~"$job_id"'
LEGEND = "{{name}} ({{job_id}})"


def _series(metric: str) -> str:
    return f"{metric}{{{JOB}}}"


LOSS = _series("kitchen_train_loss")
MFU = _series("job_id:kitchen_train_mfu_ratio:avg1m")
TOKENS = _series("job_id:kitchen_train_tokens:rate1m")
P50 = _series("job_id:kitchen_train_step_duration_seconds:p50_1m")
P99 = _series("job_id:kitchen_train_step_duration_seconds:p99_1m")
GOODPUT = _series("kitchen_train_goodput_ratio")
MEMORY = _series("kitchen_train_peak_memory_bytes")
RESTARTS = _series("kitchen_job_attempts_total") + " - 1"
PROGRESS = _series("kitchen_train_step") + " / " + _series("kitchen_train_total_steps")


def _glance(title: str, description: str, unit: str, expr: str) -> stat.Panel:
    return stat_panel(title, description, unit, expr, LEGEND, width=3)


def build() -> Dashboard:
    return (
        kitchen_dashboard(
            UID,
            "Kitchen run",
            "One training run: loss, MFU, throughput, step time, goodput, memory, restarts. "
            "Guide: docs/observability.md",
        )
        .with_variable(
            multi_value_variable("job_id", "Job", "label_values(kitchen_train_loss, job_id)")
        )
        .with_row(dashboard.Row("At a glance"))
        .with_panel(
            _glance(
                "Progress", "Latest step over the steps the job will run.", "percentunit", PROGRESS
            )
        )
        .with_panel(_glance("Loss", "Training loss at the latest report.", "none", LOSS))
        .with_panel(_glance("MFU", "Model FLOPs utilization, 1-minute mean.", "percentunit", MFU))
        .with_panel(
            _glance("Tokens/s", "Training tokens per second, 1-minute rate.", "short", TOKENS)
        )
        .with_panel(_glance("Step time p50", "Median step time over the last minute.", "s", P50))
        .with_panel(
            _glance(
                "Goodput", "Share of wall time spent on steps that count.", "percentunit", GOODPUT
            )
        )
        .with_panel(_glance("Peak memory", "Peak accelerator memory.", "bytes", MEMORY))
        .with_panel(
            _glance("Restarts", "Attempts after the first, preemptions included.", "none", RESTARTS)
        )
        .with_row(dashboard.Row("Training"))
        .with_panel(
            timeseries_panel(
                "Loss",
                "Training loss at each report, and evaluation loss when the job evaluates. "
                "Healthy: falls fast, then slowly, with noise but no jumps; eval loss follows "
                "train loss. NaN, or a jump that stays: divergence. Eval rising while train "
                "falls: over-fitting.",
                "none",
                [
                    target(LOSS, "train " + LEGEND, "A"),
                    target(_series("kitchen_train_eval_loss"), "eval " + LEGEND, "B"),
                ],
            )
        )
        .with_panel(
            timeseries_panel(
                "MFU",
                "Model FLOPs utilization: achieved training FLOP/s over the accelerator's peak. "
                "Healthy: flat after warm-up (30-50% for large dense models on H100). A sag "
                "means a slow node, throttling or input stalls.",
                "percentunit",
                [target(MFU, LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Throughput",
                "Training tokens per second, from the token counter (restarts do not reset it).",
                "short",
                [target(TOKENS, LEGEND)],
                axis_label="tokens/s",
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Step time p50 / p99",
                "Step time quantiles over the last minute. p99 far above p50 every few minutes "
                "is checkpointing (a sawtooth); p50 rising is a straggler or a slow input.",
                "s",
                [target(P50, "p50 " + LEGEND, "A"), target(P99, "p99 " + LEGEND, "B")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Goodput",
                "Productive training time over wall time since the job started. Restarts, "
                "rollbacks, checkpoint stalls and data stalls lower it. Healthy: above 90%.",
                "percentunit",
                [target(GOODPUT, LEGEND)],
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "Restarts and preemptions",
                "Attempts after the first (crashes, hangs, node loss and preemptions; each "
                "resumes from the last checkpoint) and, of those, preemptions, which are not "
                "failures.",
                "none",
                [
                    target(RESTARTS, "restarts " + LEGEND, "A"),
                    target(_series("kitchen_job_preemptions_total"), "preemptions " + LEGEND, "B"),
                ],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Eval scores",
                "Scores of eval jobs (held-out loss, lm-evaluation-harness tasks), one series "
                "per task, metric and checkpoint step: a sweep over a run's checkpoints draws "
                "one line per step. Did the model get better? Later steps score higher "
                "(accuracy) or lower (loss, perplexity). Guide: docs/eval.md",
                "none",
                [target(_series("kitchen_eval_score"), "{{task}} {{metric}} step {{step}}")],
            )
        )
        .with_row(dashboard.Row("Memory, data and optimizer"))
        .with_panel(
            timeseries_panel(
                "Peak memory",
                "Peak accelerator memory of the job. Close to the device's capacity: the next "
                "longer batch may run out of memory.",
                "bytes",
                [target(MEMORY, LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Padding fraction",
                "Share of tokens in each batch that are padding: compute spent on nothing. "
                "Packing keeps pretraining near 0; SFT with short examples pads more.",
                "percentunit",
                [target(_series("kitchen_train_padding_ratio"), LEGEND)],
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "Gradient norm",
                "Gradient norm before clipping. Spikes often come a few steps before a loss "
                "spike; a steady climb is an early sign of divergence.",
                "none",
                [target(_series("kitchen_train_grad_norm"), LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Learning rate",
                "The schedule as the trainer applies it: warm-up, then decay.",
                "none",
                [target(_series("kitchen_train_learning_rate"), LEGEND)],
                min_value=0,
            )
        )
        .build()
    )
