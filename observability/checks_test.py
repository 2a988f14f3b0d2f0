"""Dashboards and rules against a real Prometheus scraping a real /metrics endpoint.

The endpoint is the launcher's own exporter fed by a simulated fleet (simulated_fleet.py);
tests/ repeats check_queries_against with the real launcher running a real job.
"""

import pytest

from observability import prometheus_api
from observability.checks import check_queries_against
from observability.prometheus_server import running_prometheus
from observability.queries import Query, all_queries
from observability.simulated_fleet import SimulatedFleet


@pytest.fixture(scope="module")
def fleet():
    launcher = SimulatedFleet()
    launcher.start()
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def prometheus(fleet, tmp_path_factory):
    target = f"127.0.0.1:{fleet.port}"
    with running_prometheus([target], tmp_path_factory.mktemp("prometheus")) as url:
        yield url


def test_every_panel_query_and_rule_returns_data(prometheus):
    queries = all_queries()
    assert {q.kind for q in queries} == {"panel", "variable", "record", "alert"}
    assert check_queries_against(prometheus, require_finite=True, wait_s=30) == []


def test_job_id_and_the_scrape_job_label_do_not_collide(prometheus):
    """The Kitchen job id arrives as `job_id`; `job` is the scrape job on every series, so the
    scrape config needs no honor_labels and nothing is renamed to `exported_job`."""
    jobs = prometheus_api.instant_query(prometheus, "group by (job_id, job) (kitchen_train_loss)")
    assert sorted((s["metric"]["job_id"], s["metric"]["job"]) for s in jobs) == [
        ("j-0001", "kitchen-launcher"),
        ("j-0002", "kitchen-launcher"),
        ("j-0003", "kitchen-launcher"),
        ("j-0004", "kitchen-launcher"),
        ("j-0005", "kitchen-launcher"),
    ]
    assert prometheus_api.instant_query(prometheus, 'up{job="kitchen-launcher"} == 1')
    assert not prometheus_api.instant_query(prometheus, '{exported_job!=""}')


def test_missing_data_and_bad_queries_are_reported(prometheus):
    broken = [
        Query("missing metric", "panel", 'kitchen_no_such_metric{job_id=~".+"}'),
        Query("bad syntax", "alert", "rate(kitchen_train_loss[5m]"),
        Query("unrecorded", "record", "vector(1)", "job_id:kitchen_not_recorded:rate1m"),
    ]
    failures = check_queries_against(prometheus, queries=broken, require_rules_loaded=False)
    assert len(failures) == 3, failures
    assert failures[0].startswith("missing metric: no data")
    assert failures[1].startswith("bad syntax: bad_data")
    assert "job_id:kitchen_not_recorded:rate1m" in failures[2]
    (not_loaded,) = check_queries_against(
        prometheus, queries=[Query("x", "alert", "vector(1)", "Y")]
    )
    assert not_loaded == "x: not loaded in Prometheus (check rule_files)"


def test_nan_loss_fires_its_alert_on_live_data(fleet, prometheus):
    fleet.jobs[0].diverged = True
    try:
        firing = 'ALERTS{alertname="KitchenLossNotFinite", alertstate="firing"}'
        failures = check_queries_against(
            prometheus, queries=[Query("NaN alert", "panel", firing)], wait_s=20
        )
        assert failures == []
        alerts = prometheus_api.instant_query(prometheus, firing)
        assert [a["metric"]["job_id"] for a in alerts] == ["j-0001"]
    finally:
        fleet.jobs[0].diverged = False
