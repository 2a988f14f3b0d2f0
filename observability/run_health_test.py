"""The report's thresholds are the Prometheus alerts' thresholds: `kitchen report` and the pager
call the same run unhealthy. Each constant of run_health marked "as <alert>" is checked against
the number in that alert's expression in the committed rule file."""

import re

import pytest

from observability import run_health
from observability.queries import RULE_FILES, rule_queries

# (alert, a pattern whose group is the threshold in the alert's expression, run_health's name)
THRESHOLDS = [
    ("KitchenLossSpike", r"kitchen_train_loss > (\S+) \* quantile_over_time\(", "SPIKE_RATIO"),
    ("KitchenLossSpike", r"kitchen_train_loss\[30m\]\) > (\S+)$", "SPIKE_MARGIN"),
    ("KitchenMFUDrop", r"< (\S+) \* avg_over_time\(kitchen_train_mfu_ratio\[", "SAG_RATIO"),
    ("KitchenStepTimeRegression", r"> (\S+) \* \(rate\(", "STEP_SLOWDOWN_RATIO"),
    ("KitchenGoodputLow", r"^kitchen_train_goodput_ratio < (\S+)$", "GOODPUT_FLOOR"),
]


def alert_expressions() -> dict[str, str]:
    """{alert: expression on one line} of Kitchen's rule files."""
    return {
        q.name: " ".join(q.expr.split())
        for path in RULE_FILES
        for q in rule_queries(path)
        if q.kind == "alert"
    }


@pytest.mark.parametrize("alert, pattern, name", THRESHOLDS, ids=[t[2] for t in THRESHOLDS])
def test_run_health_threshold_is_the_alerts(alert, pattern, name):
    expr = alert_expressions()[alert]
    match = re.search(pattern, expr)
    assert match, f"{alert} changed shape ({expr!r}): update run_health.{name} and this test"
    assert float(match.group(1)) == getattr(run_health, name), f"{alert}: {expr!r}"


def test_every_threshold_marked_as_an_alert_is_checked():
    source = open(run_health.__file__).read()
    marked = re.findall(r"^(\w+(?:, \w+)*) = .*# as (\w+)$", source, re.M)
    names = {(alert, name) for names, alert in marked for name in names.split(", ")}
    assert names == {(alert, name) for alert, _, name in THRESHOLDS}
