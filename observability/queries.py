"""Every PromQL expression Kitchen ships, pulled out of the committed dashboards and rule files.

Grafana cannot run here, so its dashboards are checked by sending their queries to a real
Prometheus (observability/checks.py). Grafana-only syntax is rewritten first: template variables
become a match-all regex, `$__rate_interval` and friends become fixed durations, and a
`label_values(metric, label)` variable becomes `group by (label) (metric)`.
"""

import json
import re
from pathlib import Path
from typing import NamedTuple

import yaml

# Not resolve(): under Bazel that would leave the runfiles tree for the source tree.
OBSERVABILITY_DIR = Path(__file__).absolute().parent
PROMETHEUS_CONFIG = OBSERVABILITY_DIR / "prometheus" / "prometheus.yml"
RULE_FILES = (
    OBSERVABILITY_DIR / "prometheus" / "rules" / "recording.rules.yml",
    OBSERVABILITY_DIR / "prometheus" / "rules" / "alerts.rules.yml",
)
DASHBOARDS_DIR = OBSERVABILITY_DIR / "grafana" / "dashboards"

# Grafana's built-in interval variables, as Grafana would fill them for a 1-hour view.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$")


class Query(NamedTuple):
    """One expression and where it came from (for error messages)."""

    source: str  # "kitchen-run.json: panel 'Loss' (A)" or "alerts.rules.yml: KitchenMFUDrop"
    kind: str  # "panel", "variable", "record" or "alert"
    expr: str  # PromQL, Grafana variables already substituted
    name: str = ""  # the rule's name: the recorded series or the alert


def substitute_grafana_variables(expr: str, variables: set[str]) -> str:
    """Rewrites Grafana variables so Prometheus can run the expression.

    A dashboard variable (all of Kitchen's are multi-value with "All") becomes `.+`, which is
    what "All" selects; an unknown variable is an error rather than a silently broken query.
    """

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name in variables:
            return ".+"
        raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")

    return _VARIABLE.sub(replace, expr)


def variable_query_to_promql(query: str) -> str:
    """`label_values(metric, label)` -> a PromQL query that is non-empty iff the list is."""
    match = _LABEL_VALUES.match(query)
    if not match:
        return query  # a plain PromQL query variable
    label = match.group(2)
    selector = match.group(1) or f'{{{label}!=""}}'
    return f"group by ({label}) ({selector})"


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])  # collapsed rows nest their panels


def dashboard_queries(path: Path) -> list[Query]:
    """The queries of every panel target and query variable in one dashboard JSON file."""
    board = json.loads(Path(path).read_text())
    variables = board.get("templating", {}).get("list", [])
    names = {v["name"] for v in variables}
    queries = []
    for variable in variables:
        if variable.get("type") != "query":
            continue
        raw = variable["query"]
        raw = raw["query"] if isinstance(raw, dict) else raw
        expr = substitute_grafana_variables(variable_query_to_promql(raw), names)
        queries.append(Query(f"{path.name}: variable ${variable['name']}", "variable", expr))
    for panel in _panels(board.get("panels", [])):
        for target in panel.get("targets") or []:
            if target.get("hide"):
                continue
            source = f"{path.name}: panel {panel.get('title')!r} ({target.get('refId')})"
            expr = substitute_grafana_variables(target["expr"], names)
            queries.append(Query(source, "panel", expr))
    return queries


def rule_queries(path: Path) -> list[Query]:
    """Recording rules (kind "record") and alert expressions (kind "alert") of one rule file."""
    doc = yaml.safe_load(Path(path).read_text())
    queries = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                source = f"{path.name}: record {rule['record']}"
                queries.append(Query(source, "record", rule["expr"], rule["record"]))
            else:
                source = f"{path.name}: alert {rule['alert']}"
                queries.append(Query(source, "alert", rule["expr"], rule["alert"]))
    return queries


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def all_queries() -> list[Query]:
    """Every committed dashboard query and rule, dashboards first."""
    queries = [q for path in dashboard_files() for q in dashboard_queries(path)]
    return queries + [q for path in RULE_FILES for q in rule_queries(path)]
