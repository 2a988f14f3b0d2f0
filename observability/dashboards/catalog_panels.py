"""Rows and panels drawn from the metric catalog (protos/metric_catalog.py): one target per
catalog metric that names a panel, so a new metric reaches its dashboard without an edit here.
Panels whose queries are derived (recording rules, ratios) are the dashboard modules' own."""

from grafana_foundation_sdk.builders import dashboard, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants

from observability.dashboards.panels import target, timeseries_panel
from protos import metric_catalog, metric_panels
from protos.metric_catalog import Source

# Every Kitchen dashboard picks jobs with the multi-value $job_id variable.
JOB = 'job_id=~"$job_id"'
LEGEND = "{{name}} ({{job_id}})"
_LEGENDS = {
    Source.PROGRESS: LEGEND,
    Source.RANK: "rank {{rank}} on {{host}} ({{job_id}})",
    Source.MOE_LAYER: "layer {{layer}} " + LEGEND,
}


def selector(name: str) -> str:
    """The selected jobs' samples of one series (a catalog sample or a recording rule)."""
    return f"{name}{{{JOB}}}"


def series(field: str, source: Source = Source.PROGRESS) -> str:
    """The selected jobs' samples of a catalog metric, by its field."""
    return selector(metric_catalog.metric(field, source).sample)


def catalog_panel(panel: metric_panels.Panel) -> timeseries.Panel:
    targets: list[cogbuilder.Builder[cogvariants.Dataquery]] = [
        target(selector(m.sample), m.legend + _LEGENDS[m.source], chr(ord("A") + i))
        for i, m in enumerate(metric_catalog.panel_metrics(panel))
    ]
    return timeseries_panel(
        panel.title,
        panel.help,
        panel.unit,
        targets,
        min_value=panel.min_value,
        max_value=panel.max_value,
    )


def add_rows(
    board: dashboard.Dashboard,
    which: metric_panels.Board,
    derived: dict[metric_panels.Row, list[cogbuilder.Builder]],
) -> dashboard.Dashboard:
    """Each row of `which` in order: its catalog panels (in catalog order), then `derived`'s."""
    unknown = set(derived) - {row for row in metric_panels.ROWS if row.board == which}
    if unknown:
        raise ValueError(f"derived panels for rows not on {which.value}: {unknown}")
    for row in metric_panels.ROWS:
        if row.board != which:
            continue
        board = board.with_row(dashboard.Row(row.title))
        drawn = dict.fromkeys(m.panel for m in metric_catalog.CATALOG if m.panel is not None)
        for spec in drawn:
            if spec.row == row:
                board = board.with_panel(catalog_panel(spec))
        for panel in derived.get(row, []):
            board = board.with_panel(panel)
    return board
