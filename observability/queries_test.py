"""Pulling PromQL out of Grafana dashboards and rule files."""

import json

import pytest

from observability.queries import (
    all_queries,
    dashboard_queries,
    substitute_grafana_variables,
    variable_query_to_promql,
)


def test_grafana_variables_become_promql():
    expr = 'rate(x{job_id=~"$job_id", pool=~"${pool}"}[$__rate_interval]) or y{t="[[team]]"}'
    assert substitute_grafana_variables(expr, {"job_id", "pool", "team"}) == (
        'rate(x{job_id=~".+", pool=~".+"}[1m]) or y{t=".+"}'
    )
    with pytest.raises(ValueError, match=r"unknown Grafana variable \$jbo_id"):
        substitute_grafana_variables('x{job_id=~"$jbo_id"}', {"job_id"})


def test_label_values_become_a_grouping_query():
    assert variable_query_to_promql("label_values(kitchen_train_loss, job_id)") == (
        "group by (job_id) (kitchen_train_loss)"
    )
    assert variable_query_to_promql("label_values(pool)") == 'group by (pool) ({pool!=""})'
    assert variable_query_to_promql("up == 1") == "up == 1"


def test_collapsed_rows_are_searched_and_hidden_targets_skipped(tmp_path):
    board = {
        "templating": {"list": [{"type": "query", "name": "job_id", "query": {"query": "up"}}]},
        "panels": [
            {
                "type": "row",
                "title": "r",
                "panels": [
                    {
                        "title": "inner",
                        "targets": [
                            {"refId": "A", "expr": 'a{job_id=~"$job_id"}'},
                            {"refId": "B", "expr": "b", "hide": True},
                        ],
                    },
                ],
            },
        ],
    }
    path = tmp_path / "board.json"
    path.write_text(json.dumps(board))
    queries = dashboard_queries(path)
    assert [(q.kind, q.expr) for q in queries] == [("variable", "up"), ("panel", 'a{job_id=~".+"}')]
    assert queries[1].source == "board.json: panel 'inner' (A)"


def test_all_committed_queries_are_found():
    queries = all_queries()
    kinds = [q.kind for q in queries]
    assert kinds.count("variable") == 3 and kinds.count("panel") >= 25  # + kitchen-serve
    assert kinds.count("record") == 12 and kinds.count("alert") == 19
    assert all("$" not in q.expr for q in queries if q.kind in ("panel", "variable"))
