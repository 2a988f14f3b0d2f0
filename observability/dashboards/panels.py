"""The building blocks Kitchen's dashboards share: one datasource, panels with units and help."""

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    StackingMode,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

# The uid the provisioned datasource carries (observability/grafana/provisioning/datasources).
DATASOURCE_UID = "kitchen-prometheus"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
REFRESH = "10s"
DEFAULT_RANGE = ("now-3h", "now")


def target(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).range()


def timeseries_panel(
    title: str,
    description: str,
    unit: str,
    targets: list[cogbuilder.Builder[cogvariants.Dataquery]],  # the SDK's type (list is invariant)
    *,
    axis_label: str = "",
    min_value: float | None = None,
    max_value: float | None = None,
    stacked: bool = False,
    width: int = 12,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .targets(targets)
        .line_width(1)
        .fill_opacity(30 if stacked else 0)
        .axis_label(axis_label)
        .legend(
            common.VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(StackingMode.NORMAL))
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    return panel


def stat_panel(
    title: str, description: str, unit: str, expr: str, legend: str, width: int = 4
) -> stat.Panel:
    """A big number (the latest value) with a sparkline, one per series."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(4)
        .with_target(target(expr, legend))
        .graph_mode(BigValueGraphMode.AREA)
        .color_mode(BigValueColorMode.VALUE)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def multi_value_variable(name: str, label: str, query: str) -> dashboard.QueryVariable:
    """A dropdown filled from Prometheus label values, several or "All" selectable."""
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def kitchen_dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kitchen"])
        .refresh(REFRESH)
        .time(*DEFAULT_RANGE)
        .timezone("browser")
        .editable()
    )
