"""The fleet dashboard: is the launcher keeping up? Queue, waits, jobs by state, pools."""

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards.panels import (
    kitchen_dashboard,
    multi_value_variable,
    stat_panel,
    target,
    timeseries_panel,
)

UID = "kitchen-fleet"
POOL = 'pool=~"$pool"'


def build() -> Dashboard:
    queued = f"sum by (pool) (kitchen_queue_depth{{{POOL}}})"
    return (
        kitchen_dashboard(
            UID,
            "Kitchen fleet",
            "The launcher and its pools: queue depth, queue waits, jobs by state, pool usage. "
            "Guide: docs/observability.md",
        )
        .with_variable(
            multi_value_variable("pool", "Pool", "label_values(kitchen_pool_capacity, pool)")
        )
        .with_row(dashboard.Row("At a glance"))
        .with_panel(
            stat_panel(
                "Launcher up",
                "1 when Prometheus scraped the launcher last time, 0 when it could not.",
                "none",
                'up{job="kitchen-launcher"}',
                "{{instance}}",
            )
        )
        .with_panel(stat_panel("Queued", "Jobs waiting for resources.", "none", queued, "{{pool}}"))
        .with_panel(
            stat_panel(
                "Running",
                "Jobs in state RUNNING.",
                "none",
                f'sum(kitchen_jobs{{state="RUNNING", {POOL}}})',
                "running",
            )
        )
        .with_panel(
            stat_panel(
                "Queue wait p99",
                "99th percentile of the wait before start, over 5 minutes.",
                "s",
                f"pool:kitchen_job_queue_wait_seconds:p99_5m{{{POOL}}}",
                "{{pool}}",
            )
        )
        .with_panel(
            stat_panel(
                "Tokens/s",
                "Training tokens per second, all jobs of the pool.",
                "short",
                f"pool:kitchen_train_tokens:rate1m{{{POOL}}}",
                "{{pool}}",
            )
        )
        .with_panel(
            stat_panel(
                "Restarts (1 h)",
                "New attempts in the last hour, all jobs of the pool.",
                "none",
                f"sum by (pool) (increase(kitchen_job_attempts_total{{{POOL}}}[1h]))",
                "{{pool}}",
            )
        )
        .with_row(dashboard.Row("Queue"))
        .with_panel(
            timeseries_panel(
                "Queue depth",
                "Jobs waiting, per pool. Healthy: drains back to 0 between bursts of "
                "submissions. A floor that only rises: the pool is too small.",
                "none",
                [target(queued, "{{pool}}")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Queue wait p50 / p99",
                "Time from submission to start for jobs that started in the last 5 minutes. "
                "A job still queued is not counted: read it with queue depth.",
                "s",
                [
                    target(
                        f"pool:kitchen_job_queue_wait_seconds:p50_5m{{{POOL}}}", "p50 {{pool}}", "A"
                    ),
                    target(
                        f"pool:kitchen_job_queue_wait_seconds:p99_5m{{{POOL}}}", "p99 {{pool}}", "B"
                    ),
                ],
                min_value=0,
            )
        )
        .with_row(dashboard.Row("Jobs and pools"))
        .with_panel(
            timeseries_panel(
                "Jobs by state",
                "Jobs the launcher knows, stacked by state. FAILED rising while RUNNING falls "
                "is a bad image or config; PREEMPTED jobs return to the queue.",
                "none",
                [target(f"sum by (state) (kitchen_jobs{{{POOL}}})", "{{state}}")],
                stacked=True,
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Pool throughput",
                "Training tokens per second per pool: how much useful work each pool does.",
                "short",
                [target(f"pool:kitchen_train_tokens:rate1m{{{POOL}}}", "{{pool}}")],
                axis_label="tokens/s",
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Pool usage",
                "Share of each pool's nodes held by running jobs. Near 100% with a queue: "
                "the pool is the bottleneck. Low with a queue: jobs ask for more than is free "
                "at once (gang admission), or a team quota holds them.",
                "percentunit",
                [target(f"pool:kitchen_pool_nodes_in_use:ratio{{{POOL}}}", "{{pool}}")],
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "GPUs in use",
                "GPUs held by running jobs against the pool's capacity (0 on CPU pools).",
                "none",
                [
                    target(
                        f'sum by (pool) (kitchen_pool_in_use{{resource="gpus", {POOL}}})',
                        "in use {{pool}}",
                        "A",
                    ),
                    target(
                        f'sum by (pool) (kitchen_pool_capacity{{resource="gpus", {POOL}}})',
                        "capacity {{pool}}",
                        "B",
                    ),
                ],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Running jobs per pool",
                "Jobs in state RUNNING, per pool.",
                "none",
                [target(f'sum by (pool) (kitchen_jobs{{state="RUNNING", {POOL}}})', "{{pool}}")],
                stacked=True,
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Pool goodput",
                "Goodput of the pool's jobs, weighted by each job's throughput.",
                "percentunit",
                [target(f"pool:kitchen_train_goodput_ratio:weighted1m{{{POOL}}}", "{{pool}}")],
                min_value=0,
                max_value=1,
            )
        )
        .with_row(dashboard.Row("Launcher"))
        .with_panel(
            timeseries_panel(
                "Scheduler pass p99",
                "Time of one scheduling pass over the queue (99th percentile, 5 minutes). "
                "Kitchen's goal is under 50 ms with 10,000 queued jobs.",
                "s",
                [target("kitchen:kitchen_scheduler_pass_duration_seconds:p99_5m", "p99")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Restarts per pool",
                "New attempts per pool in the last hour. A spike on one pool points at its "
                "machines; on all pools, at the image or the launcher.",
                "none",
                [
                    target(
                        f"sum by (pool) (increase(kitchen_job_attempts_total{{{POOL}}}[1h]))",
                        "{{pool}}",
                    )
                ],
                min_value=0,
            )
        )
        .build()
    )
