"""The serve dashboard: is this serve job answering, and how fast? Fed by the launcher's
/metrics (the job's heartbeat: load, KV blocks, latency quantiles of the last window); the
serve job's own /metrics has the full histograms (docs/serve.md)."""

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards.panels import (
    kitchen_dashboard,
    multi_value_variable,
    stat_panel,
    target,
    timeseries_panel,
)

UID = "kitchen-serve"
JOB = 'job_id=~"$job_id"'
LEGEND = "{{name}} ({{job_id}})"


def _series(metric: str) -> str:
    return f"{metric}{{{JOB}}}"


RUNNING = _series("kitchen_serve_running_requests")
WAITING = _series("kitchen_serve_waiting_requests")
USED = _series("kitchen_serve_kv_blocks_used")
FREE = _series("kitchen_serve_kv_blocks_free")
TOKENS = _series("kitchen_serve_generated_tokens_per_second")
TTFT_P50, TTFT_P99 = (
    _series("kitchen_serve_ttft_p50_seconds"),
    _series("kitchen_serve_ttft_p99_seconds"),
)
ITL_P50, ITL_P99 = (
    _series("kitchen_serve_itl_p50_seconds"),
    _series("kitchen_serve_itl_p99_seconds"),
)
KV_USE = f"{USED} / clamp_min({USED} + {FREE}, 1)"


def build() -> Dashboard:
    return (
        kitchen_dashboard(
            UID,
            "Kitchen serve",
            "One serve job (kind: serve): requests, latency, throughput, KV-cache blocks, "
            "preemptions. Guide: docs/serve.md",
        )
        .with_variable(
            multi_value_variable(
                "job_id", "Job", "label_values(kitchen_serve_kv_blocks_free, job_id)"
            )
        )
        .with_row(dashboard.Row("At a glance"))
        .with_panel(
            stat_panel(
                "Running", "Requests in the continuous batch now.", "none", RUNNING, LEGEND, 4
            )
        )
        .with_panel(
            stat_panel(
                "Waiting", "Requests queued or preempted, waiting.", "none", WAITING, LEGEND, 4
            )
        )
        .with_panel(
            stat_panel(
                "Tokens/s", "Generated tokens per second, all requests.", "short", TOKENS, LEGEND, 4
            )
        )
        .with_panel(
            stat_panel(
                "TTFT p99", "Time to first token, p99 of the last window.", "s", TTFT_P99, LEGEND, 4
            )
        )
        .with_panel(
            stat_panel(
                "KV cache used",
                "Share of the paged KV-cache blocks in use.",
                "percentunit",
                KV_USE,
                LEGEND,
                4,
            )
        )
        .with_row(dashboard.Row("Latency and load"))
        .with_panel(
            timeseries_panel(
                "Time to first token p50 / p99",
                "From a request's arrival to its first token, over each heartbeat window. It "
                "grows with the queue (waiting) and with long prompts (prefill).",
                "s",
                [target(TTFT_P50, "p50 " + LEGEND, "A"), target(TTFT_P99, "p99 " + LEGEND, "B")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Inter-token latency p50 / p99",
                "Between two tokens of one request: one engine step. It grows with the batch; "
                "p99 spikes are steps that also prefilled a prompt.",
                "s",
                [target(ITL_P50, "p50 " + LEGEND, "A"), target(ITL_P99, "p99 " + LEGEND, "B")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Requests running / waiting",
                "Running: in the continuous batch. Waiting: queued, or preempted and waiting to "
                "be recomputed. Waiting that keeps growing: more load than the job can serve.",
                "none",
                [
                    target(RUNNING, "running " + LEGEND, "A"),
                    target(WAITING, "waiting " + LEGEND, "B"),
                ],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "KV-cache blocks used / free",
                "Paged KV-cache blocks. All used with requests waiting: the batch is bounded "
                "by memory; preemptions follow.",
                "none",
                [target(USED, "used " + LEGEND, "A"), target(FREE, "free " + LEGEND, "B")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Generated tokens/s and preemptions",
                "Throughput over each heartbeat window, and requests preempted so far (their "
                "blocks were taken back; they are recomputed, never dropped).",
                "short",
                [
                    target(TOKENS, "tokens/s " + LEGEND, "A"),
                    target(_series("kitchen_serve_job_preemptions"), "preemptions " + LEGEND, "B"),
                ],
                min_value=0,
            )
        )
        .build()
    )
