"""The run dashboard's "Health by rank" row: stragglers and silent data corruption, one series
per rank (at most launcher/metrics.py's RANK_SERIES_LIMIT ranks per job). docs/reliability.md
shows what each looks like in a fault-injection run."""

from grafana_foundation_sdk.builders import timeseries

from observability.dashboards.panels import target, timeseries_panel

RANK_LEGEND = "rank {{rank}} on {{host}} ({{job_id}})"


def straggler_scores(job: str) -> timeseries.Panel:
    return timeseries_panel(
        "Straggler score by rank",
        "Each rank's busy time (step time minus the time it waits on its peers) over the "
        "median rank's. Healthy: every rank near 1. One rank far above 1 while the others sit "
        "at or below it: that rank is the straggler, and everyone waits for it "
        "(KitchenStraggler fires above 1.5 for 10 minutes).",
        "none",
        [target(f"kitchen_train_rank_straggler_score{{{job}}}", RANK_LEGEND)],
        min_value=0,
    )


def collective_wait(job: str) -> timeseries.Panel:
    return timeseries_panel(
        "Collective wait by rank",
        "Mean time per step each rank spends blocked in collectives, waiting for the others. "
        "A straggler shows the other way round: it waits least, all its peers wait most.",
        "s",
        [target(f"kitchen_train_rank_collective_wait_seconds{{{job}}}", RANK_LEGEND)],
        min_value=0,
    )


def silent_data_corruption(job: str) -> timeseries.Panel:
    return timeseries_panel(
        "Silent data corruption",
        "Replica checks each rank lost (its parameters or optimizer state differed from the "
        "majority), and the job's rollbacks after them. Healthy: no series above 0. A rank "
        "above 0: suspect its host's hardware (KitchenSilentDataCorruption).",
        "none",
        [
            target(f"kitchen_train_rank_sdc_mismatches{{{job}}}", "lost checks " + RANK_LEGEND),
            target(f"kitchen_train_sdc_rollbacks_total{{{job}}}", "rollbacks {{job_id}}", "B"),
        ],
        min_value=0,
    )
