"""Every kitchen_* series a dashboard, recording rule or alert reads is one the exporter writes.

checks_test runs each query on a real Prometheus, but an alert whose series is gone is simply
never firing, and that reads as healthy; this catches a name the catalog no longer exports."""

import re

from observability.queries import all_queries
from observability.simulated_fleet import SimulatedFleet
from protos.metric_catalog import CATALOG

# A raw series name; recording rules' names (level:metric:operation) are not raw series.
_SERIES = re.compile(r"(?<![:\w])kitchen_\w+(?![:\w])")


def _exported() -> set[str]:
    """The sample names of a simulated fleet's /metrics, and every catalog metric's (some are
    reported only by kinds the fleet does not run, e.g. PPO's value loss)."""
    fleet = SimulatedFleet()
    fleet.tick()
    scraped = {s.name for family in fleet.metrics.registry.collect() for s in family.samples}
    return scraped | {m.sample for m in CATALOG}


def test_every_series_a_query_reads_is_exported():
    exported = _exported()
    missing = {
        (name, query.source)
        for query in all_queries()
        for name in _SERIES.findall(query.expr)
        if name not in exported
    }
    assert not missing, sorted(missing)


def test_a_dropped_series_would_be_caught():
    assert "kitchen_rl_update_seconds" not in _exported()  # #30: PPO no longer reports it
    assert _SERIES.findall("rate(kitchen_rl_update_seconds[5m]) / job_id:kitchen_x:avg1m") == [
        "kitchen_rl_update_seconds"
    ]
