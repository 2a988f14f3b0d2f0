"""Checks Kitchen's dashboards and rules against a live Prometheus: the stand-in for Grafana.

`check_queries_against(url)` returns a list of human-readable failures (empty = all good):
- every dashboard panel query and template variable returns data;
- every recording rule's expression returns data, and so does its recorded series;
- every alert expression parses (/api/v1/format_query) and evaluates without error;
- every rule of Kitchen's rule files is loaded in that Prometheus and healthy.
tests/ reuses it against a Prometheus that scrapes the real launcher running a real job.
"""

import math
import time

from observability import prometheus_api
from observability.prometheus_api import PrometheusError
from observability.queries import Query, all_queries


def _non_finite(result: list[dict]) -> list[str]:
    """Labels of the series whose current value is NaN or infinite."""
    return [str(s["metric"]) for s in result if not math.isfinite(float(s["value"][1]))]


def _check_query(url: str, query: Query, require_finite: bool) -> list[str]:
    if query.kind == "alert":
        # An alert that is not firing has an empty result: parsing and evaluating is the check.
        prometheus_api.format_query(url, query.expr)
        prometheus_api.instant_query(url, query.expr)
        return []
    exprs = [query.expr] + ([query.name] if query.kind == "record" else [])
    failures = []
    for expr in exprs:
        result = prometheus_api.instant_query(url, expr)
        if not result:
            failures.append(f"{query.source}: no data for {expr!r}")
        elif require_finite and (bad := _non_finite(result)):
            failures.append(f"{query.source}: NaN/Inf for {expr!r} in {', '.join(bad)}")
    return failures


def _check_rules_loaded(url: str, queries: list[Query]) -> list[str]:
    loaded = {rule["name"]: rule for rule in prometheus_api.rules(url)}
    failures = []
    for query in queries:
        if query.kind not in ("record", "alert"):
            continue
        rule = loaded.get(query.name)
        if rule is None:
            failures.append(f"{query.source}: not loaded in Prometheus (check rule_files)")
        elif rule["health"] != "ok":
            failures.append(f"{query.source}: health {rule['health']}: {rule.get('lastError')}")
    return failures


def check_queries_against(
    prometheus_url: str,
    *,
    queries: list[Query] | None = None,
    require_finite: bool = False,
    require_rules_loaded: bool = True,
    wait_s: float = 0.0,
) -> list[str]:
    """Runs every committed query against `prometheus_url`; returns the failures.

    require_finite: also fail on NaN/Inf values (right for a fleet where every job is stepping;
      a finished job legitimately gives NaN quantiles of an idle histogram).
    require_rules_loaded: the Prometheus was started with Kitchen's rule files (as
      observability.prometheus_server does) and every rule must be loaded and healthy.
    wait_s: retry until no failures or this many seconds passed (rates need two scrapes,
      recorded series one rule evaluation); the last attempt's failures are returned.
    """
    queries = all_queries() if queries is None else queries
    deadline = time.monotonic() + wait_s
    while True:
        failures = []
        for query in queries:
            try:
                failures += _check_query(prometheus_url, query, require_finite)
            except PrometheusError as err:
                failures.append(f"{query.source}: {err}")
        if require_rules_loaded:
            failures += _check_rules_loaded(prometheus_url, queries)
        if not failures or time.monotonic() >= deadline:
            return failures
        time.sleep(0.5)
